#include "lockstep/schedule.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "lockstep/errors.h"

namespace lockstep {

void LrSchedule::Validate() const {
  if (!(peak > 0) || !std::isfinite(peak)) {
    throw InvalidArgumentError("schedule: peak learning rate must be positive and finite, got " + std::to_string(peak));
  }
  if (warmup_steps < 0) throw InvalidArgumentError("schedule: warmup_steps must be >= 0");
  if (decay == Decay::kCosine && decay_steps <= 0) {
    throw InvalidArgumentError("schedule: cosine decay needs decay_steps > 0, got " + std::to_string(decay_steps));
  }
  if (!(final_fraction >= 0 && final_fraction <= 1)) {
    throw InvalidArgumentError("schedule: final_fraction must be in [0, 1], got " + std::to_string(final_fraction));
  }
}

double LrSchedule::operator()(int64_t step) const {
  step = std::max<int64_t>(step, 0);
  double factor = 1.0;
  if (warmup_steps > 0 && step < warmup_steps) {
    factor = static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
  }
  switch (decay) {
    case Decay::kConstant:
      break;
    case Decay::kCosine: {
      const double t = std::clamp(static_cast<double>(step - warmup_steps) / static_cast<double>(decay_steps), 0.0, 1.0);
      factor *= final_fraction + (1.0 - final_fraction) * 0.5 * (1.0 + std::cos(M_PI * t));
      break;
    }
    case Decay::kRsqrt: {
      const double w = static_cast<double>(std::max<int64_t>(warmup_steps, 1));
      factor *= std::sqrt(w / std::max(static_cast<double>(step + 1), w));
      break;
    }
  }
  return peak * factor;
}

}  // namespace lockstep
