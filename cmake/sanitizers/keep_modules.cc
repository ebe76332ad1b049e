// Preloaded into the multi-rank tests of the sanitizer builds (never into a
// release build): dlclose does nothing, so the Open MPI components and
// libraries that MPI_Init loaded stay mapped until exit.
// - LeakSanitizer reports at exit; with the components unmapped, the
//   allocations they made have no module name and cmake/sanitizers/lsan.supp
//   cannot name them; mapped, they can, and the fast unwinder is enough (the
//   slow one costs ~11 s of start-up per process that loads libtorch).
// - ThreadSanitizer stops the process when a library that a called_from_lib
//   suppression matched is unloaded (Open MPI unloads libpmix in MPI_Finalize).
// Not instrumented itself: it is also preloaded into mpirun.
extern "C" int dlclose(void* handle) {
  (void)handle;
  return 0;
}
