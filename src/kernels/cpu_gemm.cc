#include "lockstep/cpu_gemm.h"

#include "absl/strings/str_cat.h"
#include "lockstep/errors.h"

#if LOCKSTEP_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

namespace lockstep {

bool HaveCpuGemm() { return LOCKSTEP_HAVE_DNNL != 0; }

void CpuGemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float* a, int64_t lda,
             const float* b, int64_t ldb, float beta, float* c, int64_t ldc) {
#if LOCKSTEP_HAVE_DNNL
  const dnnl_status_t status =
      dnnl_sgemm(trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (status != dnnl_success) {
    throw Error(absl::StrCat("oneDNN sgemm (", m, "x", n, "x", k, ") failed with status ", static_cast<int>(status)));
  }
#else
  (void)trans_a, (void)trans_b, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b, (void)ldb,
      (void)beta, (void)c, (void)ldc;
  throw Error("CpuGemm: this build has no oneDNN (LOCKSTEP_WITH_DNNL=OFF)");
#endif
}

}  // namespace lockstep
