// distrun-shm: collectives over one POSIX shared-memory segment per process group.
//
// Torch-free on purpose (fast to compile, testable on raw bytes); shm_backend.cpp maps
// torch's c10d::Backend calls onto these primitives.
//
// Segment layout (one per group, fixed size whatever the tensors):
//   header      magic, size, slot and ring sizes, abort flag
//   ctrl[n]     one cache line per rank: its signal counter (a futex word), its waiter count,
//               the CPU it last signalled from
//   slots[2][n] two sets of one staging buffer per rank; step s uses set s % 2, so a rank
//               writes step s + 1 while slower ranks still read step s
//   rings[n][n] one byte ring per ordered pair (src -> dst) for send / recv
//
// Synchronisation is by counters, not locks: every rank signals the same number of times in
// each step of each collective, so "rank j has signalled v times" means the same point of the
// program on every rank. Before a rank writes its slot of set b it waits until every rank has
// signalled the first signal of the previous step, which each rank gives only after finishing
// its reads of the step before that (the last user of set b).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

namespace distrun_shm {

enum class DType : int { F32, F64, BF16, F16, I8, I16, I32, I64, U8, BOOL };
enum class Op : int { SUM, AVG, MIN, MAX, PRODUCT, BAND, BOR, BXOR, PREMUL_SUM };

size_t dtype_size(DType dt);
const char* dtype_name(DType dt);
const char* op_name(Op op);
// Whether `op` is defined on `dt`; when not, `why` says so.
bool op_supported(DType dt, Op op, std::string* why);

// out[i] = srcs[0][i] op srcs[1][i] op ... (in that order); half types accumulate in float32
// and round once. `out` may alias srcs[0] or srcs[1] only. `premul` scales each term first
// (PREMUL_SUM); `divisor` divides the result (AVG).
void reduce_into(DType dt, Op op, void* out, const void* const* srcs, int nsrc, size_t count,
                 double premul, int divisor);

// A failure a caller should report as a distributed error (dead peer, timeout, abort).
struct PeerError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Header;
struct Ctrl;
struct Ring;

class Group {
 public:
  // Maps segment `name` (creating it with the right size when `create`). `pids` are the
  // group's ranks' process ids (to tell a dead peer from a slow one).
  Group(const std::string& name, bool create, int rank, int size, size_t slot_bytes,
        size_t ring_bytes, std::chrono::milliseconds timeout, std::vector<int64_t> pids);
  ~Group();
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  static size_t segment_bytes(int size, size_t slot_bytes, size_t ring_bytes);
  static void unlink(const std::string& name);

  int rank() const { return rank_; }
  int size() const { return size_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  // Marks the segment failed (the others raise instead of waiting for us) and this group too.
  void abort(const std::string& why);
  bool broken() const { return !broken_.empty(); }
  const std::string& broken_reason() const { return broken_; }

  // Collectives on contiguous memory (set_op names the operation in errors first).
  void allreduce(void* buf, size_t count, DType dt, Op op, double premul);
  void broadcast(void* buf, size_t nbytes, int root);
  void allgather(const void* in, size_t nbytes, void* const* outs);
  void gather(const void* in, size_t nbytes, void* const* outs, int root);
  void scatter(const void* const* ins, void* out, size_t nbytes, int root);
  void reduce_scatter(const void* const* ins, void* out, size_t count, DType dt, Op op,
                      double premul);
  void alltoall(const void* const* ins, const size_t* in_bytes, void* const* outs,
                const size_t* out_bytes);
  void barrier();

  // Point to point: FIFO per (src, dst) pair. post_* queue a transfer and move what fits now;
  // progress() moves more of every queued one; done(id) tells whether one finished.
  uint64_t post_send(const void* buf, size_t nbytes, int dst, int64_t tag);
  uint64_t post_recv(void* buf, size_t nbytes, int src, int64_t tag);
  bool p2p_done(uint64_t id) const;
  // Moves what can move now, without waiting.
  void p2p_poll() { progress(); }
  // Progresses until `id` is done, within the timeout.
  void p2p_wait(uint64_t id);

  void set_op(const char* label) { op_label_ = label; }
  // Chunks up to this size are reduced whole by every rank (one signal, no slicing).
  void set_small_bytes(size_t n) { small_bytes_ = n; }

 private:
  struct P2P {
    uint64_t id;
    bool send;
    int peer;
    char* user;
    size_t nbytes;
    int64_t tag;
    size_t pos = 0;  // bytes of [16-byte header | payload] moved so far
    unsigned char hdr[16];
  };

  char* slot(int set, int r) const;
  Ring* ring(int src, int dst) const;
  char* ring_data(int src, int dst) const;
  void begin_step();
  void end_step();
  void signal();
  void wait_rank(int r, uint32_t value);
  void wait_all(uint32_t value);
  void check_peers(const std::vector<int>& waiting_for);
  [[noreturn]] void fail(const std::string& msg);
  bool progress_one(P2P& op);
  bool progress();
  void reduce_step(size_t count, DType dt, Op op, double premul, void* out,
                   const void* const* srcs);

  std::string name_;
  int rank_, size_;
  size_t slot_bytes_, ring_bytes_, map_bytes_ = 0;
  size_t small_bytes_ = 64 * 1024;
  std::chrono::milliseconds timeout_;
  std::vector<int64_t> pids_;
  char* base_ = nullptr;
  Header* header_ = nullptr;
  Ctrl* ctrl_ = nullptr;
  char* slots_ = nullptr;
  char* rings_ = nullptr;
  uint32_t seq_ = 0;         // signals given so far (the same on every rank at one point)
  uint32_t prev_first_ = 0;  // the counter after the first signal of the previous step
  uint32_t cur_first_ = 0;
  uint64_t step_ = 0;
  int64_t spin_ns_ = 200 * 1000;  // this group's spin budget per wait (adapts: wait_rank)
  std::string broken_;
  const char* op_label_ = "collective";
  std::vector<std::deque<P2P>> sends_, recvs_;
  uint64_t next_id_ = 1;
  std::unordered_set<uint64_t> pending_;  // ids of queued transfers not yet finished
};

}  // namespace distrun_shm
