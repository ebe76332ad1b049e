// Communicator's own logic, on the single-process backend: Split hands back
// groups that an Abort of their parent reaches, for as long as they live.
#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <string>
#include <thread>

#include "lockstep/communicator.h"

namespace lockstep {
namespace {

using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

TEST(CommunicatorTest, AbortReachesEveryGroupSplitFromIt) {
  std::unique_ptr<Communicator> world = MakeSingleProcessCommunicator();
  std::unique_ptr<Communicator> group = world->Split(0, 0);
  std::unique_ptr<Communicator> subgroup = group->Split(3, 1);
  std::unique_ptr<Communicator> grandchild = subgroup->Split(0, 0);
  std::unique_ptr<Communicator> gone = world->Split(1, 0);
  gone->Barrier();
  gone.reset();  // a group destroyed before the abort is not reached (nor touched)
  EXPECT_EQ(group->world_size(), 1);
  EXPECT_EQ(group->backend(), "single_process");

  world->Abort("rank 3 died");
  for (Communicator* c : {world.get(), group.get(), subgroup.get(), grandchild.get()}) {
    EXPECT_THAT([&] { c->Barrier(); }, ThrowsMessage<CollectiveError>(HasSubstr("rank 3 died")));
  }
  // The first reason stays.
  group->Abort("another reason");
  EXPECT_THAT([&] { group->Barrier(); }, ThrowsMessage<CollectiveError>(HasSubstr("rank 3 died")));
  // A split of an aborted communicator fails at its first collective.
  EXPECT_THROW(world->Split(0, 0), CollectiveError);
}

TEST(CommunicatorTest, AbortOfAGroupLeavesItsParentAndSiblingsAlone) {
  std::unique_ptr<Communicator> world = MakeSingleProcessCommunicator();
  std::unique_ptr<Communicator> group = world->Split(0, 0);
  std::unique_ptr<Communicator> sibling = world->Split(0, 0);
  std::unique_ptr<Communicator> child = group->Split(0, 0);
  group->Abort("this group only");
  EXPECT_THAT([&] { child->Barrier(); }, ThrowsMessage<CollectiveError>(HasSubstr("this group only")));
  world->Barrier();
  sibling->Barrier();
  at::Tensor t = at::ones({3});
  world->AllReduce(t, ReduceOp::kSum);
  EXPECT_TRUE(t.equal(at::ones({3})));
}

// Groups made and destroyed on one thread while another aborts their parent
// (a coordination client hearing of a dead peer): no group is reached once it
// is gone, and the thread's next collective fails with the reason. Meant for
// the sanitizer builds as much as for the checks.
TEST(CommunicatorTest, GroupsComeAndGoWhileTheirParentIsAborted) {
  std::unique_ptr<Communicator> world = MakeSingleProcessCommunicator();
  std::atomic<int> made{0};
  std::string failure;
  std::thread training([&] {
    try {
      for (int i = 0; i < 1000000; ++i) {
        std::unique_ptr<Communicator> group = world->Split(i % 3, 0);
        std::unique_ptr<Communicator> child = group->Split(0, 0);
        made.fetch_add(1);
        child->Barrier();
        group->Barrier();
      }
    } catch (const CollectiveError& e) {
      failure = e.what();
    }
  });
  while (made.load() < 100) std::this_thread::yield();
  world->Abort("a peer is gone");
  training.join();
  EXPECT_THAT(failure, HasSubstr("a peer is gone"));
}

}  // namespace
}  // namespace lockstep
