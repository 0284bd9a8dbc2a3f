// The small_seq kernels of head dim 512 (see small_seq_kernels.cuh).
#include "small_seq_kernels.cuh"

FA_SMALL_SEQ_HEAD_DIM(512)
