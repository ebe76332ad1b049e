// Checkpoints: one directory per step, one shard file per rank and a manifest.
//
//   <directory>/step_00001200/shard_00000.pt   rank 0's shard
//                             shard_00001.pt   ...
//                             manifest.pb      step, world size, partitioning,
//                                              config fingerprint, each shard's
//                                              size and CRC32C, metrics, the
//                                              pieces of split tensors
//   <directory>/latest                         "step_00001200"
//
// A shard is a dictionary of named values in PyTorch's own format (torch.save's
// zip): "model/<parameter or buffer name>" tensors, the optimizer's state under
// "optimizer/" as its codec writes it (optimizer_state_codec.h: "<parameter
// name>/<field>" for SGD, Adam and AdamW; "archive" bytes for other optimizers),
// "rng/cpu" (libtorch's CPU generator state), "data/epoch",
// "data/batch_in_epoch", "step", "trainer_state" (the unfinished summary period
// and the actions' state), and a trainer subclass's "custom/tensor/<name>" and
// "custom/bytes/<name>" (CustomState). Python reads it with torch.load(path).
//
// A sharded train state (TrainState::layout, from ShardedDataParallel) saves in
// each shard only that rank's slices of the split tensors; the manifest lists each
// split tensor's key, global shape and the (rank, begin, end) ranges of its
// row-major flattening that each shard holds. Restore reads the ranges the current
// layout needs from the shards that hold them, so a checkpoint loads on any world
// size under any strategy; ConsolidateCheckpoint writes one file of whole tensors.
// A layout of a trainer's own (a partitioning name other than the replicated one
// and no table of pieces) loads on the same world size and partitioning only.
//
// Commit is atomic: every rank writes its shard into <directory>/.tmp_step_N and
// fsyncs it, then reports its size and CRC32C through the coordination service and
// meets the others at a barrier; rank 0 writes and fsyncs the manifest, renames the
// directory into place, fsyncs <directory>, and only then replaces "latest"
// (write, fsync, rename). A crash at any point leaves the previous checkpoint as
// the latest valid one; a directory without a valid manifest is never loaded.
//
// A write error (a full disk, EIO, a read-only file system) is a CheckpointError
// naming the file and the cause, for synchronous and asynchronous saves alike; the
// unfinished .tmp_step_N it leaves is removed by the next successful save. A
// damaged checkpoint is never deleted: retention leaves alone every checkpoint
// newer than the one just committed, and a save to the step of a damaged one moves
// that aside (<name>.damaged.<unix seconds>) first.
//
// Asynchronous saves copy the state in memory on the training thread and write on
// a background thread; the next Save, Wait() and the destructor wait for it.
//
// Every rank constructs the manager with the same options and calls Save with the
// same steps, in the same order.
#ifndef LOCKSTEP_CHECKPOINT_H_
#define LOCKSTEP_CHECKPOINT_H_

#include <cstdint>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "absl/time/time.h"
#include "lockstep/data.h"
#include "lockstep/communicator.h"
#include "lockstep/errors.h"
#include "lockstep/mesh.h"
#include "lockstep/train_state.h"

namespace lockstep {

class CoordinationClient;
namespace checkpoint {
class Manifest;
}

// A checkpoint is missing, truncated, corrupt, partial or incompatible, or cannot
// be written. The message names the file and the reason.
class CheckpointError : public Error {
 public:
  using Error::Error;
};

struct CheckpointOptions {
  std::string directory;
  int64_t every_steps = 0;  // Due(): 0 never
  int keep_last = 3;        // the newest K are kept
  int keep_best = 0;        // and the best M by best_metric ("task/metric")
  std::string best_metric;
  bool best_max = false;    // higher is better
  bool async = true;
  // With async: parameters and optimizer state are copied by the background thread
  // too, while the caller runs the next step's forward and backward; the caller
  // must call AwaitSnapshot() before it changes them (Trainer does, through
  // StepOptions::before_update). Buffers, RNG state and extras are copied at once.
  bool overlap_copy = false;
  // "data_parallel_replicated": every rank's shard holds the whole state, so a
  // checkpoint loads on any world size.
  std::string partitioning = "data_parallel_replicated";
  uint64_t config_fingerprint = 0;
  std::string config_text;  // what the fingerprint covers, to name a difference
  absl::Duration barrier_timeout = absl::Minutes(10);
};

// What a rank saves besides the model and the optimizer.
struct ShardExtras {
  IteratorPosition data;
  std::string trainer_state;  // BaseTrainer::SaveTrainerState()
  CustomState custom = {};    // BaseTrainer::SaveCustomState()
};

// A checkpoint found on disk, checked.
struct FoundCheckpoint {
  std::string path;  // the step directory
  int64_t step = 0;
  int world_size = 0;
  std::shared_ptr<const checkpoint::Manifest> manifest;
};

class CheckpointManager {
 public:
  // `coordination` may be null only in a world of one (or to Restore only). Borrowed.
  CheckpointManager(CheckpointOptions options, int rank, int world_size, CoordinationClient* coordination);
  // Waits for a save in flight; its failure is printed, not thrown.
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  bool Due(int64_t step) const { return options_.every_steps > 0 && step > 0 && step % options_.every_steps == 0; }

  // Saves `state` at state.step, with `metrics` ("task/metric" -> value) in the
  // manifest. Waits for the previous save first. With async, returns once the state
  // is copied; otherwise once the checkpoint is committed. Errors: CheckpointError
  // (this save, or the previous async one, failed), CoordinationError,
  // InvalidArgumentError for an optimizer that cannot be saved (the job layer asks
  // FindOptimizerStateCodec at start-up, so that this does not wait for a save).
  void Save(const TrainState& state, const ShardExtras& extras, const std::map<std::string, double>& metrics,
            bool emergency = false);
  // Blocks until the save in flight is committed; rethrows its failure.
  void Wait();
  // Tensor parallelism (tensor_parallel.h): the model's parameters that `layouts`
  // mark as split are this rank's shards over `model_axis`. Save then gathers
  // each of them, and each optimizer value of their shape, over the axis, so that
  // the checkpoint holds whole tensors as a replicated one does (and loads on any
  // mesh, or with none); Restore reads the whole tensors and keeps this rank's
  // shard. Both become collectives over the axis. Null or a world of one: off.
  void set_model_axis(Communicator* model_axis, int model_index, std::vector<ParameterLayout> layouts);
  // A sharded strategy (ZeRO-1/2) over the data axis of a mesh whose model axis
  // is set: the train state's layout slices over `data_axis`, not over the whole
  // world. Save then also all-gathers each optimizer value over the data axis
  // before the model axis gathers it, so the checkpoint again holds whole tensors
  // (recorded as replicated: it loads on any mesh and strategy); Restore slices
  // them again. Not owned; null: the layout spans the world.
  void set_data_axis(Communicator* data_axis) { data_axis_ = data_axis; }
  // A fault-tolerant job whose world changed (a rank left): this rank's new place
  // and the coordination client that spans the new world. Waits for the save in
  // flight first. Replicated state only (a sharded layout is per world).
  void SetWorld(int rank, int world_size, CoordinationClient* coordination);
  // Blocks until the save in flight has copied the state (overlap_copy); after it
  // the caller may change parameters and optimizer state. Cheap when nothing waits.
  void AwaitSnapshot();
  // Seconds the caller's thread spent in the last Save.
  double last_save_pause_seconds() const { return last_pause_seconds_; }
  const CheckpointOptions& options() const { return options_; }

  // The newest checkpoint under `directory` whose manifest and shards all check
  // out; each one skipped is described in `skipped` ("<file>: <reason>").
  static std::optional<FoundCheckpoint> FindLatest(const std::string& directory, std::vector<std::string>* skipped);
  // The step directory that `directory`/latest names (the last committed save), or
  // nullopt when there is no `latest` file. Throws CheckpointError when the file
  // cannot be read or does not hold one step directory name ("step_<digits>"): a
  // garbled or hand-edited `latest` never points outside `directory`.
  static std::optional<std::string> ReadLatest(const std::string& directory);
  // Checks one step directory: manifest CRC, every shard's size and CRC32C.
  // Throws CheckpointError naming the file and the reason.
  static FoundCheckpoint Validate(const std::string& path);
  // Reads and checks the manifest only (the shards are checked as they load).
  static FoundCheckpoint ReadManifestOnly(const std::string& path);

  // Loads this rank's shard of `found` into `state` (and the CPU RNG) and returns
  // the extras. Throws CheckpointError when the world size differs and the
  // partitioning does not allow it, or the config fingerprint differs (naming the
  // first differing line); InvalidArgumentError when the optimizer cannot be
  // restored (see FindOptimizerStateCodec).
  ShardExtras Restore(const FoundCheckpoint& found, TrainState& state) const;

  struct Job;  // one save's copied state; defined in checkpoint.cc

 private:
  void Write(const Job& job);
  // Keeps keep_last / keep_best / pinned among the checkpoints up to the one just
  // committed; newer ones (damaged, say) are never deleted.
  void ApplyRetention(int64_t committed_step);

  const CheckpointOptions options_;
  int rank_;
  int world_size_;
  CoordinationClient* coordination_;  // Not owned.
  // A sharded layout on a mesh (set_data_axis): throws InvalidArgumentError
  // unless it slices over the data axis and keeps the parameters whole.
  void CheckMeshLayout(const ShardedLayout& layout) const;
  Communicator* model_axis_ = nullptr;      // Not owned; see set_model_axis
  int model_index_ = 0;
  Communicator* data_axis_ = nullptr;       // Not owned; see set_data_axis
  std::map<std::string, ParameterLayout> split_;  // the split parameters, by name
  std::future<void> in_flight_;        // the async save, if any
  std::shared_future<void> snapshot_;  // its copy of the state (overlap_copy)
  std::map<std::string, at::Tensor> staging_;  // async copies, reused from save to save
  double last_pause_seconds_ = 0;
};

// Writes the checkpoint in `step_directory` as one file that Python's torch.load
// reads as a plain dict: "model/<name>" and "optimizer/<name>/<field>" whole, in
// their shapes, however the checkpoint was split over ranks; step, data position
// and RNG state as rank 0 saved them. Written to a temporary name, then renamed.
// Throws CheckpointError naming the file and the reason.
void ConsolidateCheckpoint(const std::string& step_directory, const std::string& output_file);

// Name of the step directory: step_00001200.
std::string CheckpointDirName(int64_t step);

// Opaque bytes (an optimizer's archive, a trainer's custom bytes, the summary
// period) as a 1-D uint8 CPU tensor, as shards and in-memory snapshots hold them,
// and back. TensorToBytes: CheckpointError for anything but a 1-D uint8 tensor.
at::Tensor BytesToTensor(const std::string& bytes);
std::string TensorToBytes(const at::Tensor& t);

}  // namespace lockstep

#endif  // LOCKSTEP_CHECKPOINT_H_
