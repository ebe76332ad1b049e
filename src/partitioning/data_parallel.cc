#include "lockstep/data_parallel.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/nn/module.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <map>
#include <optional>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "lockstep/agreement.h"
#include "lockstep/coordination.h"
#include "lockstep/hashing.h"
#include "lockstep/host.h"
#include "lockstep/timeline.h"
#include "gradient_readiness.h"

namespace lockstep {

struct GradientBucketer::State {
  struct Bucket {
    std::vector<size_t> params;
    at::Tensor flat;   // padded to a multiple of the host's ranks with a hierarchy
    at::Tensor slice;  // hierarchy: this rank's reduced slice of flat
    std::shared_ptr<Work> scatter;  // hierarchy: the reduce-scatter in the host
    std::shared_ptr<Work> work;     // null while a hierarchy's scatter is pending
    // For the timeline: when it was launched and first seen complete.
    Timeline::Clock::time_point launched, done;
    bool seen_done = false;
  };

  Communicator* communicator = nullptr;  // Not owned.
  std::unique_ptr<GradientCommHook> hook;  // null: plain all-reduce
  // The hierarchy's groups, or null (flat): the ranks of this host, and the
  // ranks of this local index on every host.
  std::unique_ptr<Communicator> local;
  std::unique_ptr<Communicator> cross;
  // Flat, when the launcher interleaved the hosts (ranks 0 and 2 on one host):
  // the same ranks in host order, so that the all-reduce's exchanges between
  // neighbours stay within a host as they do with the ranks in blocks. Null: the
  // ranks already are in host order (or order_by_host is off, or the backend
  // could not reorder them; description() says which).
  std::unique_ptr<Communicator> ordered;
  // What the flat buckets travel on: `ordered`, or the communicator itself.
  Communicator* flat_group() const { return ordered != nullptr ? ordered.get() : communicator; }
  // Hierarchy: the buckets whose reduce-scatter in the host is queued and whose
  // slices have not yet been sent between hosts, in launch order.
  std::deque<size_t> scattering;
  std::string description;
  int64_t steps = 0;  // synchronised steps finished
  // Bucket-size tuning (DataParallelOptions::autotune_bucket_bytes).
  std::vector<size_t> agreed_order;  // the parameter order of the layout
  std::vector<size_t> candidates;
  size_t candidate = 0;  // being measured
  int autotune_steps = 0;
  bool tuning = false;
  int settle = 0;  // intervals to skip after a new layout
  std::optional<std::chrono::steady_clock::time_point> last_finish;
  std::vector<double> intervals;
  std::vector<double> medians;  // per candidate, the slowest rank's
  Timeline* timeline = nullptr;  // Not owned.

  bool tracing() const { return timeline != nullptr && timeline->recording(); }
  // Notes the buckets in flight that have completed by now (the timeline's end
  // of their spans).
  void PollDone(size_t up_to) {
    const auto now = Timeline::Clock::now();
    for (size_t b = 0; b < up_to && b < buckets.size(); ++b) {
      Bucket& bucket = buckets[b];
      if (bucket.work && !bucket.seen_done && bucket.work->IsCompleted()) {
        bucket.seen_done = true;
        bucket.done = now;
      }
    }
  }
  CollectiveOptions collective;
  std::vector<at::Tensor> parameters;
  std::vector<size_t> bucket_of;  // parameter index -> bucket
  // Parameter index -> its slice of its bucket's flat buffer, shaped like it. The
  // parameters' .grad are these views, so that backward accumulates straight into
  // the buffers that are all-reduced (no copy in or out).
  std::vector<at::Tensor> views;
  std::vector<Bucket> buckets;
  std::vector<std::vector<size_t>> layout;
  std::unique_ptr<internal::GradientReadiness> readiness;  // launches buckets from autograd hooks
  size_t bucket_bytes = 0;
  double wait_seconds = 0.0;  // blocked in Finish, summed
  // The order in which gradients became final in the first synchronised backward;
  // the buckets are rebuilt in rank 0's order after it.
  std::vector<size_t> ready_order;
  bool rebuilt = false;

  // Options for a small tensor of `dtype` on the parameters' device (collectives
  // of a few values: a median, host-name hashes).
  at::TensorOptions SmallOptions(at::ScalarType dtype) const {
    return parameters.empty() ? at::TensorOptions(dtype) : parameters.front().options().dtype(dtype);
  }

  // Groups the parameters, in `order`, into buckets of at most bucket_bytes (a new
  // bucket also when the dtype changes), and tells the hook that buckets changed.
  void Layout(const std::vector<size_t>& order) {
    buckets.clear();
    layout.clear();
    size_t bytes = 0;
    for (size_t i : order) {
      const at::Tensor& p = parameters[i];
      const size_t size = p.numel() * p.element_size();
      const bool dtype_change = !buckets.empty() && parameters[buckets.back().params.front()].scalar_type() != p.scalar_type();
      if (buckets.empty() || dtype_change || (bytes > 0 && bytes + size > bucket_bytes)) {
        buckets.emplace_back();
        bytes = 0;
      }
      buckets.back().params.push_back(i);
      bucket_of[i] = buckets.size() - 1;
      bytes += size;
    }
    at::NoGradGuard no_grad;
    for (Bucket& bucket : buckets) {
      int64_t numel = 0;
      for (size_t p : bucket.params) numel += parameters[p].numel();
      const at::TensorOptions options = parameters[bucket.params.front()].options().requires_grad(false);
      if (local != nullptr) {
        // Reduce-scattered within the host: a multiple of its ranks, zero-padded.
        const int64_t ranks = local->world_size();
        const int64_t slice = (numel + ranks - 1) / ranks;
        bucket.flat = local->AllocateCollectiveBuffer(slice * ranks, options, collective).zero_();
        bucket.slice = at::zeros({slice}, options);
      } else {
        // Where the communicator reduces fastest (shared memory for MPI on one host).
        bucket.flat = flat_group()->AllocateCollectiveBuffer(numel, options, collective).zero_();
      }
      int64_t offset = 0;
      for (size_t p : bucket.params) {
        at::Tensor& param = parameters[p];
        at::Tensor view = internal::PlainView(bucket.flat, offset, param.sizes());
        offset += param.numel();
        // Gradients already there (the rebuild after the first step) move into the
        // new buffers.
        if (param.grad().defined()) {
          view.copy_(param.grad());
          param.mutable_grad() = view;
        }
        views[p] = std::move(view);
      }
      layout.push_back(bucket.params);
    }
    readiness->SetGroups(layout);
    if (hook != nullptr) hook->OnLayoutChanged();
  }

  // After the first synchronised step: every rank takes rank 0's ready order.
  void RebuildFromReadyOrder() {
    rebuilt = true;
    std::vector<bool> seen(parameters.size(), false);
    for (size_t p : ready_order) seen[p] = true;
    for (size_t i = parameters.size(); i-- > 0;) {
      if (!seen[i]) ready_order.push_back(i);  // no gradient: keep reverse order
    }
    at::Tensor order = at::empty({static_cast<int64_t>(ready_order.size())}, at::kLong);
    for (size_t i = 0; i < ready_order.size(); ++i) order[i] = static_cast<int64_t>(ready_order[i]);
    communicator->Broadcast(order, 0, collective);
    std::vector<size_t> agreed(ready_order.size());
    for (size_t i = 0; i < agreed.size(); ++i) agreed[i] = static_cast<size_t>(order[i].item<int64_t>());
    agreed_order = agreed;
    if (tuning) {
      bucket_bytes = candidates.front();
      settle = 1;
    }
    Layout(agreed);
  }

  // After each synchronised step while tuning: the step's time; once a size has
  // its steps, the slowest rank's median, and the next size (or the choice).
  void Tune() {
    const auto now = std::chrono::steady_clock::now();
    if (last_finish && settle-- <= 0) intervals.push_back(std::chrono::duration<double>(now - *last_finish).count());
    last_finish = now;
    if (static_cast<int>(intervals.size()) < autotune_steps) return;
    std::sort(intervals.begin(), intervals.end());
    at::Tensor median = at::full({1}, intervals[intervals.size() / 2], SmallOptions(at::kDouble));
    communicator->AllReduce(median, ReduceOp::kMax, collective);
    medians.push_back(median.cpu().item<double>());
    intervals.clear();
    settle = 1;
    if (++candidate < candidates.size()) {
      bucket_bytes = candidates[candidate];
      Layout(agreed_order);
      return;
    }
    tuning = false;
    const size_t best = std::min_element(medians.begin(), medians.end()) - medians.begin();
    bucket_bytes = candidates[best];
    Layout(agreed_order);
    std::string result = "bucket autotune:";
    for (size_t i = 0; i < candidates.size(); ++i) {
      absl::StrAppend(&result, i > 0 ? "," : "",
                      absl::StrFormat(" %.3g MiB %.1f ms", candidates[i] / 1048576.0, medians[i] * 1e3));
    }
    absl::StrAppend(&result, absl::StrFormat(" -> %.3g MiB (%d bucket(s))", bucket_bytes / 1048576.0,
                                             static_cast<int>(buckets.size())));
    absl::StrAppend(&description, "; ", result);
    if (communicator->rank() == 0) std::printf("Communication: %s\n", result.c_str());
  }

  void Launch(size_t b) {
    Bucket& bucket = buckets[b];
    // Normally every gradient already is its view (Arm made it so). Not when a
    // hook or the user replaced one since: its value is copied in.
    for (size_t p : bucket.params) internal::CopyGradInto(parameters[p], views[p]);
    if (tracing()) {
      PollDone(b);
      bucket.launched = Timeline::Clock::now();
      bucket.seen_done = false;
    }
    if (local == nullptr) {
      GradientBucket unit;
      unit.index = static_cast<int>(b);
      unit.step = steps;
      unit.buffer = bucket.flat;
      for (size_t p : bucket.params) unit.gradients.push_back(views[p]);
      Communicator* group = flat_group();
      bucket.work = hook != nullptr ? hook->Run(*group, unit, collective)
                                    : group->AllReduceAsync(bucket.flat, ReduceOp::kSum, collective);
      return;
    }
    // Hierarchy: the host's sum of this rank's slice (shared memory) on the host
    // group's worker, so that backward does not wait for the host's other ranks;
    // the slices between hosts once it is done (SendBetween); the host's slices
    // back to every rank of it when Finish waits.
    bucket.scatter = local->ReduceScatterAsync(bucket.slice, bucket.flat, ReduceOp::kSum, collective);
    bucket.work.reset();
    scattering.push_back(b);
    SendBetween(/*wait=*/false);
  }

  // Hierarchy: starts the all-reduce between hosts of every bucket at the front of
  // `scattering` whose reduce-scatter in the host is done; with `wait`, of all of
  // them, waiting for each. In launch order, which every rank shares, as the
  // between-hosts group's collectives need. Called as buckets launch, as
  // gradients become ready, and by Finish.
  void SendBetween(bool wait) {
    while (!scattering.empty()) {
      Bucket& bucket = buckets[scattering.front()];
      if (!wait && !bucket.scatter->IsCompleted()) return;
      bucket.scatter->Wait();  // rethrows the reduce-scatter's error
      bucket.scatter.reset();
      GradientBucket unit;
      unit.index = static_cast<int>(scattering.front());
      unit.step = steps;
      unit.buffer = bucket.slice;
      scattering.pop_front();
      std::shared_ptr<Work> between = hook != nullptr ? hook->Run(*cross, unit, collective)
                                                      : cross->AllReduceAsync(bucket.slice, ReduceOp::kSum, collective);
      Communicator* host = local.get();
      bucket.work = Then(std::move(between), [host, flat = bucket.flat, slice = bucket.slice, options = collective] {
        host->AllGather(flat, slice, options);
      });
    }
  }

  // Each rank's host, numbered in order of the host's first rank: consecutive
  // ranks `ranks_per_host` to a host, or (0) by host name, a collective.
  std::vector<int> HostOf(int ranks_per_host) const {
    const int world = communicator->world_size();
    std::vector<int> host_of(world);
    if (ranks_per_host > 0) {
      if (world % ranks_per_host != 0) {
        throw InvalidArgumentError(absl::StrCat("hierarchical all-reduce: ranks_per_host ", ranks_per_host,
                                                " does not divide the world of ", world, " ranks"));
      }
      for (int r = 0; r < world; ++r) host_of[r] = r / ranks_per_host;
      return host_of;
    }
    // Every rank's host name, as a hash, from every rank.
    const at::TensorOptions options = SmallOptions(at::kLong);
    at::Tensor all = at::empty({world}, options);
    communicator->AllGather(all, at::full({1}, static_cast<int64_t>(StableHash(HostName())), options), collective);
    const at::Tensor hashes = all.cpu();
    std::map<int64_t, int> hosts;  // hash -> host index, in order of first rank
    for (int r = 0; r < world; ++r) {
      const int64_t h = hashes.data_ptr<int64_t>()[r];
      host_of[r] = hosts.emplace(h, static_cast<int>(hosts.size())).first->second;
    }
    return host_of;
  }

  // Flat, when some host's ranks are not consecutive: `ordered` holds the same
  // ranks sorted by host (then by rank), a collective. When the backend cannot
  // split (MPI without MPI_THREAD_MULTIPLE), the ranks stay as they are and the
  // description says so. Every rank decides alike: host_of is the same everywhere.
  void OrderByHost(const std::vector<int>& host_of) {
    if (std::is_sorted(host_of.begin(), host_of.end())) return;
    const int world = static_cast<int>(host_of.size());
    std::string hosts = absl::StrJoin(host_of.begin(), host_of.begin() + std::min(world, 16), " ");
    if (world > 16) absl::StrAppend(&hosts, " ...");
    const int rank = communicator->rank();
    std::string order;
    try {
      ordered = communicator->Split(0, host_of[rank] * world + rank, collective);
      order = absl::StrCat("ranks in host order (the launcher interleaved the hosts: rank -> host ", hosts, ")");
    } catch (const InvalidArgumentError& e) {
      order = absl::StrCat("ranks in launch order, which interleaves the hosts (rank -> host ", hosts,
                           ") and crosses between them more than ranks in blocks would; not reordered: ", e.what());
    }
    // After the hierarchy's reason for being off, if any (it ends "flat all-reduce").
    description = absl::StrCat(description.empty() ? "flat all-reduce" : description, ", ", order);
  }

  // Builds the hierarchy's groups when the ranks are on several hosts with
  // several ranks on each (the same number); otherwise says why not.
  void SetUpHierarchy(const std::vector<int>& host_of) {
    const int world = communicator->world_size();
    const int rank = communicator->rank();
    std::vector<int> sizes;
    std::vector<int> local_index(world);
    for (int r = 0; r < world; ++r) {
      if (static_cast<size_t>(host_of[r]) >= sizes.size()) sizes.resize(host_of[r] + 1, 0);
      local_index[r] = sizes[host_of[r]]++;
    }
    const int hosts = static_cast<int>(sizes.size());
    const bool even = std::all_of(sizes.begin(), sizes.end(), [&](int n) { return n == sizes.front(); });
    if (hosts < 2 || sizes.front() < 2 || !even) {
      description = absl::StrCat(
          "hierarchical all-reduce off: ",
          hosts < 2 ? "every rank is on one host"
                    : (!even ? absl::StrCat("the hosts have different numbers of ranks (", absl::StrJoin(sizes, ", "), ")")
                             : "one rank per host"),
          "; flat all-reduce");
      return;
    }
    if (hook != nullptr && hook->needs_parameter_shapes()) {
      throw InvalidArgumentError(absl::StrCat("hierarchical all-reduce: the ", hook->name(),
                                              " hook needs whole buckets, and the hierarchy reduces slices of them "
                                              "between hosts; turn one of them off"));
    }
    local = communicator->Split(host_of[rank], rank, collective);
    cross = communicator->Split(local_index[rank], rank, collective);
    description = absl::StrCat("hierarchical all-reduce: ", hosts, " hosts x ", sizes.front(),
                               " ranks (reduce-scatter in the host, all-reduce of slices between hosts, all-gather "
                               "in the host)");
  }
};

GradientBucketer::GradientBucketer(Communicator* communicator, std::vector<at::Tensor> parameters,
                                   const DataParallelOptions& options)
    : state_(std::make_shared<State>()) {
  if (communicator == nullptr) throw InvalidArgumentError("GradientBucketer: no communicator");
  State& s = *state_;
  s.communicator = communicator;
  s.collective = options.collective;
  s.parameters = std::move(parameters);
  s.bucket_of.assign(s.parameters.size(), 0);
  s.views.resize(s.parameters.size());
  s.bucket_bytes = options.bucket_bytes;
  if (options.comm_hook) s.hook = options.comm_hook();
  for (size_t bytes : options.autotune_bucket_bytes) {
    if (bytes == 0) throw InvalidArgumentError("bucket autotune: a candidate size of 0 bytes");
  }
  if (!options.autotune_bucket_bytes.empty() && options.autotune_steps < 1) {
    throw InvalidArgumentError(absl::StrCat("bucket autotune: autotune_steps must be >= 1, got ", options.autotune_steps));
  }
  s.candidates = options.autotune_bucket_bytes;
  s.autotune_steps = options.autotune_steps;
  s.tuning = !s.candidates.empty();
  if (communicator->world_size() > 1 && (options.hierarchical || options.order_by_host)) {
    const int ranks_per_host = options.hierarchical ? options.ranks_per_host : 0;
    const std::vector<int> host_of = s.HostOf(ranks_per_host);
    if (options.hierarchical) s.SetUpHierarchy(host_of);
    // With ranks_per_host the hosts are consecutive ranks: nothing to reorder.
    if (s.local == nullptr && options.order_by_host && ranks_per_host == 0) s.OrderByHost(host_of);
  }
  s.description = absl::StrCat("gradient buckets: ", s.hook != nullptr ? s.hook->name() : "float32",
                               s.hook != nullptr ? " hook; " : " all-reduce; ",
                               s.description.empty() ? "flat" : s.description);
  State* state = &s;  // the readiness is the state's, so it never outlives it
  s.readiness = std::make_unique<internal::GradientReadiness>(
      s.parameters, [state](size_t b) { state->Launch(b); },
      [state](size_t p) {
        if (!state->rebuilt) state->ready_order.push_back(p);
        if (!state->scattering.empty()) state->SendBetween(/*wait=*/false);
        if (state->tracing()) state->PollDone(state->buckets.size());
      });
  // Until the first backward shows the real order: reverse registration order,
  // which is roughly the order backward produces gradients in.
  std::vector<size_t> reverse(s.parameters.size());
  for (size_t i = 0; i < reverse.size(); ++i) reverse[i] = reverse.size() - 1 - i;
  s.Layout(reverse);
}

GradientBucketer::~GradientBucketer() = default;

void GradientBucketer::Arm() {
  State& s = *state_;
  {
    at::NoGradGuard no_grad;
    for (size_t p = 0; p < s.parameters.size(); ++p) {
      if (s.parameters[p].requires_grad()) internal::PointGradAt(s.parameters[p], s.views[p]);
    }
  }
  for (State::Bucket& bucket : s.buckets) {
    bucket.work.reset();
    bucket.scatter.reset();
  }
  s.scattering.clear();
  s.readiness->Arm();
}

void GradientBucketer::Finish() {
  State& s = *state_;
  if (!s.readiness->armed()) Arm();
  s.readiness->LaunchRest();
  s.SendBetween(/*wait=*/true);
  at::NoGradGuard no_grad;
  const bool tracing = s.tracing();
  if (tracing) s.PollDone(s.buckets.size());
  for (size_t b = 0; b < s.buckets.size(); ++b) {
    State::Bucket& bucket = s.buckets[b];
    const auto wait_start = std::chrono::steady_clock::now();
    bucket.work->Wait();
    const auto wait_end = std::chrono::steady_clock::now();
    s.wait_seconds += std::chrono::duration<double>(wait_end - wait_start).count();
    if (tracing) {
      if (const auto completed = bucket.work->completed_at()) {
        bucket.done = std::max(bucket.launched, *completed);  // the backend's own note
      } else if (!bucket.seen_done) {
        bucket.done = wait_end;
      }
      const int64_t bytes = bucket.flat.numel() * bucket.flat.element_size();
      const std::string args = absl::StrCat("\"bytes\": ", bytes, ", \"parameters\": ", bucket.params.size());
      s.timeline->Add(absl::StrCat("bucket ", b, s.local != nullptr ? " hierarchical" : "",
                                   s.hook != nullptr ? absl::StrCat(" ", s.hook->name()) : std::string(" all-reduce")),
                      2 + static_cast<int>(b), bucket.launched, bucket.done, args);
      if (wait_end - wait_start > std::chrono::microseconds(20)) {
        s.timeline->Add(absl::StrCat("wait bucket ", b), 1, wait_start, wait_end, "");
      }
    }
    // The sums are in the views; a gradient that is not one (see Launch) becomes one.
    for (size_t p : bucket.params) {
      if (!internal::GradIs(s.parameters[p], s.views[p])) s.parameters[p].mutable_grad() = s.views[p];
    }
  }
  ++s.steps;
  if (!s.rebuilt) {
    s.RebuildFromReadyOrder();
  } else if (s.tuning) {
    s.Tune();
  }
}

const std::vector<std::vector<size_t>>& GradientBucketer::buckets() const { return state_->layout; }
int GradientBucketer::launched_during_backward() const { return state_->readiness->launched_during_backward(); }
double GradientBucketer::wait_seconds() const { return state_->wait_seconds; }
const std::string& GradientBucketer::description() const { return state_->description; }
void GradientBucketer::set_timeline(Timeline* timeline) { state_->timeline = timeline; }

namespace {

// One line per parameter and buffer: name, dtype, shape.
std::string Describe(torch::nn::Module& model) {
  std::ostringstream out;
  for (const auto& item : model.named_parameters()) {
    out << "param " << item.key() << " " << item.value().dtype() << " " << item.value().sizes() << "\n";
  }
  for (const auto& item : model.named_buffers()) {
    out << "buffer " << item.key() << " " << item.value().dtype() << " " << item.value().sizes() << "\n";
  }
  return out.str();
}

}  // namespace

void CheckModelsAgreeAndBroadcast(Communicator* communicator, torch::nn::Module& model, const std::string& fingerprint,
                                  const DataParallelOptions& options) {
  // Every rank learns every rank's model shape and fingerprint, so that all of
  // them fail together, naming the ranks that differ.
  const std::string shapes = Describe(model);
  int64_t weights = 0;
  for (const at::Tensor& p : model.parameters()) weights += p.numel();
  const std::vector<int64_t> mine = {static_cast<int64_t>(StableHash(shapes)),
                                     static_cast<int64_t>(StableHash(fingerprint)),
                                     static_cast<int64_t>(model.parameters().size()), weights};
  at::Tensor all = at::zeros({4 * communicator->world_size()}, at::kLong);
  if (options.coordination != nullptr) {
    // Through the key-value store: each rank publishes its four numbers, then
    // reads everyone's.
    absl::StatusOr<std::vector<std::string>> published =
        PublishAndGather(*options.coordination, absl::StrCat("lockstep/startup/", options.name, "/"),
                         absl::StrJoin(mine, " "), absl::FromChrono(options.collective.timeout));
    ThrowIfError(published.status(), "data-parallel start-up check");
    for (int r = 0; r < communicator->world_size(); ++r) {
      const std::string& theirs = (*published)[r];
      std::vector<std::string> fields = absl::StrSplit(theirs, ' ');
      for (int i = 0; i < 4; ++i) {
        int64_t value = 0;
        if (fields.size() != 4 || !absl::SimpleAtoi(fields[i], &value)) {
          throw CoordinationError(absl::StrCat("data-parallel start-up check: rank ", r, " published '", theirs, "'"));
        }
        all.data_ptr<int64_t>()[4 * r + i] = value;
      }
    }
  } else {
    communicator->AllGather(all, at::tensor(mine, at::kLong), options.collective);
  }
  const auto* v = all.data_ptr<int64_t>();
  std::string problems;
  for (int r = 1; r < communicator->world_size(); ++r) {
    if (v[4 * r] != v[0]) {
      absl::StrAppend(&problems, "; rank ", r, " has a different model (", v[4 * r + 2], " parameter tensors, ",
                      v[4 * r + 3], " weights) from rank 0 (", v[2], " parameter tensors, ", v[3], " weights)");
    }
    if (v[4 * r + 1] != v[1]) absl::StrAppend(&problems, "; rank ", r, " has a different config from rank 0");
  }
  if (!problems.empty()) {
    throw InvalidArgumentError("data-parallel start-up check failed on rank " + std::to_string(communicator->rank()) + ": " +
                               problems.substr(2));
  }
  // Rank 0's initial parameters and buffers everywhere.
  at::NoGradGuard no_grad;
  std::vector<std::shared_ptr<Work>> works;
  for (at::Tensor& p : model.parameters()) works.push_back(communicator->BroadcastAsync(p, 0, options.collective));
  for (at::Tensor& b : model.buffers()) works.push_back(communicator->BroadcastAsync(b, 0, options.collective));
  for (auto& w : works) w->Wait();
}

DataParallel::DataParallel(Communicator* communicator, torch::nn::Module& model, const std::string& fingerprint,
                           const DataParallelOptions& options)
    : communicator_(communicator),
      options_(options) {
  CheckModelsAgreeAndBroadcast(communicator_, model, fingerprint, options_);
  // Last: the buckets' buffers are allocated collectively, which needs every rank
  // to have the same parameters (checked above).
  bucketer_ = std::make_unique<GradientBucketer>(communicator_, model.parameters(), options_);
}

void DataParallel::AllReduceSum(at::Tensor& values) {
  const auto start = std::chrono::steady_clock::now();
  communicator_->AllReduce(values, ReduceOp::kSum, options_.collective);
  all_reduce_sum_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::shared_ptr<Work> DataParallel::AllReduceSumAsync(const at::Tensor& values) {
  return communicator_->AllReduceAsync(values, ReduceOp::kSum, options_.collective);
}

void DataParallel::Wait(Work& work) {
  const auto start = std::chrono::steady_clock::now();
  work.Wait();
  all_reduce_sum_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double DataParallel::communication_wait_seconds() const {
  return bucketer_->wait_seconds() + all_reduce_sum_seconds_;
}

}  // namespace lockstep
