// The small_seq kernels of head dim 128 (see small_seq_kernels.cuh).
#include "small_seq_kernels.cuh"

FA_SMALL_SEQ_HEAD_DIM(128)
