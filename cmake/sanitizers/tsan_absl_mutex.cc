// ThreadSanitizer build only (LOCKSTEP_SANITIZE=thread): makes Debian's abseil
// mutex visible to TSan.
//
// Debian's libabsl_synchronization is not built with TSan, so the annotations that
// absl::Mutex carries under TSan are compiled out of it and its lock is atomics and
// futexes that TSan never sees: every access guarded by an absl::Mutex would be
// reported as a race (checked with a two-thread counter under absl::MutexLock). The
// link wraps the absl::Mutex entry points our code calls (-Wl,--wrap, see
// LockstepTargets.cmake) with these functions, which tell TSan about each lock and
// unlock through its public mutex annotations and then call the real one. Calls made
// inside other uninstrumented libraries (gRPC's own locks) are not wrapped and need
// no wrapping: TSan sees no accesses there.
#include <absl/synchronization/mutex.h>
#include <absl/time/time.h>
#include <sanitizer/tsan_interface.h>

#ifndef LOCKSTEP_ABSL_Lock
#error "the mangled absl::Mutex names (LOCKSTEP_ABSL_*) come from LockstepTargets.cmake"
#endif

#define LS_STR2(x) #x
#define LS_STR(x) LS_STR2(x)
// The real function is `__real_<mangled>`, the wrapper `__wrap_<mangled>`.
#define LS_REAL(symbol) __asm__("__real_" LS_STR(symbol))
#define LS_WRAP_NAME(symbol) __asm__("__wrap_" LS_STR(symbol))

using absl::Condition;
using absl::Duration;
using absl::Mutex;
using absl::Time;

// The mangled names are built by CMake from abseil's inline namespace; each
// LOCKSTEP_ABSL_* macro below is one whole symbol.
extern "C" {
void RealLock(Mutex*) LS_REAL(LOCKSTEP_ABSL_Lock);
void RealUnlock(Mutex*) LS_REAL(LOCKSTEP_ABSL_Unlock);
bool RealTryLock(Mutex*) LS_REAL(LOCKSTEP_ABSL_TryLock);
void RealReaderLock(Mutex*) LS_REAL(LOCKSTEP_ABSL_ReaderLock);
void RealReaderUnlock(Mutex*) LS_REAL(LOCKSTEP_ABSL_ReaderUnlock);
void RealLockWhen(Mutex*, const Condition&) LS_REAL(LOCKSTEP_ABSL_LockWhen);
bool RealLockWhenWithTimeout(Mutex*, const Condition&, Duration) LS_REAL(LOCKSTEP_ABSL_LockWhenWithTimeout);
bool RealLockWhenWithDeadline(Mutex*, const Condition&, Time) LS_REAL(LOCKSTEP_ABSL_LockWhenWithDeadline);
void RealAwait(Mutex*, const Condition&) LS_REAL(LOCKSTEP_ABSL_Await);
bool RealAwaitWithTimeout(Mutex*, const Condition&, Duration) LS_REAL(LOCKSTEP_ABSL_AwaitWithTimeout);
bool RealAwaitWithDeadline(Mutex*, const Condition&, Time) LS_REAL(LOCKSTEP_ABSL_AwaitWithDeadline);

void WrapLock(Mutex* mu) LS_WRAP_NAME(LOCKSTEP_ABSL_Lock);
void WrapUnlock(Mutex* mu) LS_WRAP_NAME(LOCKSTEP_ABSL_Unlock);
bool WrapTryLock(Mutex* mu) LS_WRAP_NAME(LOCKSTEP_ABSL_TryLock);
void WrapReaderLock(Mutex* mu) LS_WRAP_NAME(LOCKSTEP_ABSL_ReaderLock);
void WrapReaderUnlock(Mutex* mu) LS_WRAP_NAME(LOCKSTEP_ABSL_ReaderUnlock);
void WrapLockWhen(Mutex* mu, const Condition& c) LS_WRAP_NAME(LOCKSTEP_ABSL_LockWhen);
bool WrapLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d) LS_WRAP_NAME(LOCKSTEP_ABSL_LockWhenWithTimeout);
bool WrapLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t) LS_WRAP_NAME(LOCKSTEP_ABSL_LockWhenWithDeadline);
void WrapAwait(Mutex* mu, const Condition& c) LS_WRAP_NAME(LOCKSTEP_ABSL_Await);
bool WrapAwaitWithTimeout(Mutex* mu, const Condition& c, Duration d) LS_WRAP_NAME(LOCKSTEP_ABSL_AwaitWithTimeout);
bool WrapAwaitWithDeadline(Mutex* mu, const Condition& c, Time t) LS_WRAP_NAME(LOCKSTEP_ABSL_AwaitWithDeadline);
}

namespace {

void Locked(Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_lock(mu, flags);
  __tsan_mutex_post_lock(mu, flags, 0);
}

void Unlocking(Mutex* mu, unsigned flags) {
  __tsan_mutex_pre_unlock(mu, flags);
  __tsan_mutex_post_unlock(mu, flags);
}

// A condition is evaluated inside the real call, by the waiting thread or by
// another one on its way out of Unlock, with the mutex held but before (or after)
// the annotations above: the evaluation acquires and releases the mutex for TSan
// itself, so that what it reads is ordered with the writers before and after it.
struct Annotated {
  Mutex* mu;
  const Condition* condition;
};

bool EvalAnnotated(Annotated* a) {
  __tsan_acquire(a->mu);
  const bool met = a->condition->Eval();
  __tsan_release(a->mu);
  return met;
}

}  // namespace

extern "C" {

void WrapLock(Mutex* mu) { RealLock(mu); Locked(mu, 0); }
void WrapUnlock(Mutex* mu) { Unlocking(mu, 0); RealUnlock(mu); }
bool WrapTryLock(Mutex* mu) {
  const bool got = RealTryLock(mu);
  if (got) Locked(mu, __tsan_mutex_try_lock);
  return got;
}
void WrapReaderLock(Mutex* mu) { RealReaderLock(mu); Locked(mu, __tsan_mutex_read_lock); }
void WrapReaderUnlock(Mutex* mu) { Unlocking(mu, __tsan_mutex_read_lock); RealReaderUnlock(mu); }

// LockWhen*: the mutex is held on return whatever the result.
void WrapLockWhen(Mutex* mu, const Condition& c) {
  Annotated a{mu, &c};
  RealLockWhen(mu, Condition(&EvalAnnotated, &a));
  Locked(mu, 0);
}
bool WrapLockWhenWithTimeout(Mutex* mu, const Condition& c, Duration d) {
  Annotated a{mu, &c};
  const bool met = RealLockWhenWithTimeout(mu, Condition(&EvalAnnotated, &a), d);
  Locked(mu, 0);
  return met;
}
bool WrapLockWhenWithDeadline(Mutex* mu, const Condition& c, Time t) {
  Annotated a{mu, &c};
  const bool met = RealLockWhenWithDeadline(mu, Condition(&EvalAnnotated, &a), t);
  Locked(mu, 0);
  return met;
}

// Await*: held on entry, released while waiting, held again on return.
void WrapAwait(Mutex* mu, const Condition& c) {
  Unlocking(mu, 0);
  Annotated a{mu, &c};
  RealAwait(mu, Condition(&EvalAnnotated, &a));
  Locked(mu, 0);
}
bool WrapAwaitWithTimeout(Mutex* mu, const Condition& c, Duration d) {
  Unlocking(mu, 0);
  Annotated a{mu, &c};
  const bool met = RealAwaitWithTimeout(mu, Condition(&EvalAnnotated, &a), d);
  Locked(mu, 0);
  return met;
}
bool WrapAwaitWithDeadline(Mutex* mu, const Condition& c, Time t) {
  Unlocking(mu, 0);
  Annotated a{mu, &c};
  const bool met = RealAwaitWithDeadline(mu, Condition(&EvalAnnotated, &a), t);
  Locked(mu, 0);
  return met;
}

}  // extern "C"
