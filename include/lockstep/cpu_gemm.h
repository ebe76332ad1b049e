// Row-major float32 matrix products on CPU through oneDNN's dnnl_sgemm: the
// products of Linear (linear.h) and the fused attention (attention.h), and the
// peak that MeasureMatmulFlops reports on a CPU (torch_setup.h).
//
// oneDNN (libdnnl, which libtorch itself links) generates its kernels at run time
// for the widest vector instructions the CPU has, AVX-512 included. libtorch sends
// float32 products to the system BLAS instead, and Debian's OpenBLAS 0.3.21 picks
// its AVX2 (Haswell) kernels on this machine's AMD EPYC: oneDNN's product of the GPT's
// linear shapes is about twice as fast here (benchmarks/cpu_kernels_benchmark.cc
// times both).
//
// Thread-safe (oneDNN is); each call uses the caller's OpenMP thread count, which
// at::set_num_threads sets.
#ifndef LOCKSTEP_CPU_GEMM_H_
#define LOCKSTEP_CPU_GEMM_H_

#include <cstdint>

namespace lockstep {

// Whether this build has oneDNN (LOCKSTEP_WITH_DNNL).
bool HaveCpuGemm();

// C[m, n] = alpha op(A) op(B) + beta C, row-major, with leading dimensions.
// Throws Error when oneDNN refuses (it names the status); without oneDNN, throws.
void CpuGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc);

}  // namespace lockstep

#endif  // LOCKSTEP_CPU_GEMM_H_
