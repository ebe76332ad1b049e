// Learning-rate schedules: linear warm-up composed with a decay (constant, cosine
// or inverse square root). A schedule is a value type; calling it is pure and
// thread-safe.
//
//   lr(step) = peak * warmup(step) * decay(step), step counted from 0:
//   warmup(s) = (s + 1) / warmup_steps while s < warmup_steps, else 1
//   CONSTANT: decay(s) = 1
//   COSINE:   decay(s) = f + (1 - f) * (1 + cos(pi * t)) / 2,
//             t = min(1, (s - warmup_steps) / decay_steps), f = final_fraction
//   RSQRT:    decay(s) = sqrt(w / max(s + 1, w)), w = max(warmup_steps, 1)
#ifndef LOCKSTEP_SCHEDULE_H_
#define LOCKSTEP_SCHEDULE_H_

#include <cstdint>

namespace lockstep {

struct LrSchedule {
  enum class Decay { kConstant, kCosine, kRsqrt };

  double peak = 1e-3;
  Decay decay = Decay::kConstant;
  int64_t warmup_steps = 0;
  int64_t decay_steps = 0;      // kCosine only; must be positive there
  double final_fraction = 0.0;  // kCosine only

  // Throws InvalidArgumentError naming the bad field.
  void Validate() const;
  double operator()(int64_t step) const;
};

}  // namespace lockstep

#endif  // LOCKSTEP_SCHEDULE_H_
