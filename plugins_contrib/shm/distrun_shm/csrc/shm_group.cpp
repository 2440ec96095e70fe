// The shared-memory segment of a group and the collectives on it (see shm_group.hpp).
#include "shm_group.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define DS_PAUSE() _mm_pause()
#else
#define DS_PAUSE() std::this_thread::yield()
#endif

namespace distrun_shm {

constexpr uint64_t kMagic = 0x6d68732d6e757264ULL;  // "drun-shm"
constexpr size_t kPage = 4096;

struct alignas(64) Header {
  uint64_t magic;
  uint64_t size;
  uint64_t slot_bytes;
  uint64_t ring_bytes;
  std::atomic<uint32_t> aborted;  // 0, or 1 + the rank that gave up
  char abort_msg[236];
};

struct alignas(64) Ctrl {
  std::atomic<uint32_t> seq;      // signals given: the futex word peers sleep on
  std::atomic<uint32_t> waiters;  // peers asleep (or about to be) on seq
  std::atomic<int32_t> cpu;       // the CPU the rank last signalled from (a hint for waiters)
};

struct Ring {
  alignas(64) std::atomic<uint64_t> written;  // bytes the sender has put in, ever
  alignas(64) std::atomic<uint64_t> read;     // bytes the receiver has taken out, ever
};

namespace {

size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }

size_t ctrl_off() { return round_up(sizeof(Header), kPage); }
size_t slots_off(int n) { return ctrl_off() + round_up(sizeof(Ctrl) * n, kPage); }
size_t rings_off(int n, size_t slot) { return slots_off(n) + 2 * static_cast<size_t>(n) * slot; }
size_t ring_stride(size_t ring) { return sizeof(Ring) + ring; }

long futex(std::atomic<uint32_t>* addr, int op, uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), op, val, ts, nullptr, 0);
}

bool reached(uint32_t have, uint32_t want) { return static_cast<int32_t>(have - want) >= 0; }

// Whether process `pid` has ended (gone, or a zombie its parent has not reaped yet).
bool pid_dead(int64_t pid) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/stat");
  if (!f) return true;
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  auto close = text.rfind(')');
  if (close == std::string::npos || close + 2 >= text.size()) return false;
  char state = text[close + 2];
  return state == 'Z' || state == 'X' || state == 'x';
}

using Clock = std::chrono::steady_clock;

std::string seconds(std::chrono::milliseconds t) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", t.count() / 1000.0);
  return text;
}

}  // namespace

size_t Group::segment_bytes(int size, size_t slot_bytes, size_t ring_bytes) {
  return rings_off(size, slot_bytes) +
         static_cast<size_t>(size) * static_cast<size_t>(size) * ring_stride(ring_bytes);
}

void Group::unlink(const std::string& name) { shm_unlink(name.c_str()); }

Group::Group(const std::string& name, bool create, int rank, int size, size_t slot_bytes,
             size_t ring_bytes, std::chrono::milliseconds timeout, std::vector<int64_t> pids)
    : name_(name), rank_(rank), size_(size), slot_bytes_(round_up(slot_bytes, kPage)),
      ring_bytes_(round_up(ring_bytes, 64)), timeout_(timeout), pids_(std::move(pids)),
      sends_(size), recvs_(size) {
  map_bytes_ = segment_bytes(size_, slot_bytes_, ring_bytes_);
  int fd = create ? shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600)
                  : shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0)
    throw std::runtime_error("shm backend: cannot open shared memory /dev/shm" + name + ": " +
                             std::strerror(errno));
  if (create && ftruncate(fd, static_cast<off_t>(map_bytes_)) != 0) {
    int err = errno;
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("shm backend: cannot size /dev/shm" + name + " to " +
                             std::to_string(map_bytes_) + " bytes: " + std::strerror(err));
  }
  struct stat st {};
  if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < map_bytes_) {
    close(fd);
    throw std::runtime_error("shm backend: /dev/shm" + name + " is smaller than expected");
  }
  void* p = mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int err = errno;
  close(fd);
  if (p == MAP_FAILED)
    throw std::runtime_error(std::string("shm backend: mmap failed: ") + std::strerror(err));
  base_ = static_cast<char*>(p);
  header_ = reinterpret_cast<Header*>(base_);
  ctrl_ = reinterpret_cast<Ctrl*>(base_ + ctrl_off());
  slots_ = base_ + slots_off(size_);
  rings_ = base_ + rings_off(size_, slot_bytes_);
  if (create) {
    header_->size = size_;
    header_->slot_bytes = slot_bytes_;
    header_->ring_bytes = ring_bytes_;
    for (int r = 0; r < size_; ++r) ctrl_[r].cpu.store(-1, std::memory_order_relaxed);
    header_->magic = kMagic;
  } else if (header_->magic != kMagic || header_->size != static_cast<uint64_t>(size_) ||
             header_->slot_bytes != slot_bytes_ || header_->ring_bytes != ring_bytes_) {
    munmap(base_, map_bytes_);
    base_ = nullptr;
    throw std::runtime_error("shm backend: /dev/shm" + name +
                             " has another layout (ranks disagree on DISTRUN_SHM_* settings)");
  }
}

Group::~Group() {
  if (base_) munmap(base_, map_bytes_);
}

char* Group::slot(int set, int r) const {
  return slots_ + (static_cast<size_t>(set) * size_ + r) * slot_bytes_;
}

Ring* Group::ring(int src, int dst) const {
  return reinterpret_cast<Ring*>(rings_ + (static_cast<size_t>(src) * size_ + dst) *
                                              ring_stride(ring_bytes_));
}

char* Group::ring_data(int src, int dst) const {
  return reinterpret_cast<char*>(ring(src, dst)) + sizeof(Ring);
}

// ---------------------------------------------------------------- errors and waiting

void Group::fail(const std::string& msg) {
  if (broken_.empty()) broken_ = msg;
  uint32_t expected = 0;
  if (header_->aborted.compare_exchange_strong(expected, static_cast<uint32_t>(rank_ + 1))) {
    std::snprintf(header_->abort_msg, sizeof(header_->abort_msg), "%s", msg.c_str());
  }
  for (int r = 0; r < size_; ++r) futex(&ctrl_[r].seq, FUTEX_WAKE, INT_MAX, nullptr);
  throw PeerError(msg);
}

void Group::abort(const std::string& why) {
  try {
    fail(why);
  } catch (const PeerError&) {
  }
}

void Group::check_peers(const std::vector<int>& waiting_for) {
  uint32_t who = header_->aborted.load(std::memory_order_acquire);
  if (who != 0 && static_cast<int>(who) != rank_ + 1) {
    std::string msg = "shm backend: " + std::string(op_label_) + " failed because rank " +
                      std::to_string(who - 1) + " of the group gave up (" +
                      std::string(header_->abort_msg) + ")";
    broken_ = msg;
    throw PeerError(msg);
  }
  for (int r : waiting_for) {
    if (pid_dead(pids_[r])) {
      fail("shm backend: rank " + std::to_string(r) + " of the group (pid " +
           std::to_string(pids_[r]) + ") exited during " + op_label_);
    }
  }
}

void Group::signal() {
  ++seq_;
  Ctrl& c = ctrl_[rank_];
  c.cpu.store(sched_getcpu(), std::memory_order_relaxed);
  c.seq.store(seq_, std::memory_order_seq_cst);
  if (c.waiters.load(std::memory_order_seq_cst) != 0) futex(&c.seq, FUTEX_WAKE, INT_MAX, nullptr);
}

// Waiting for a peer's counter, in three phases:
//   spin   up to spin_ns_ of pause loops: a peer running on another core is usually
//          microseconds away, and catching it here costs no system call on either side;
//   yield  a few sched_yield()s, only while spinning still pays (see below);
//   sleep  FUTEX_WAIT on the peer's counter, registered in its waiter count so that its next
//          signal() wakes us (a writer makes the FUTEX_WAKE call only when the count is not 0,
//          so peers on time cost each other nothing). A sleeping rank gives its core away for
//          the whole wait: the scheduler runs the peer (or whatever else is runnable) there.
// Spinning only pays while the peer runs elsewhere. A peer that last signalled from our own
// core cannot be running while we spin (we hold that core), so we sleep almost at once
// (kSpinSameCpuNs). Otherwise spin_ns_ adapts, per group: a wait that the spin ended grows it
// by an eighth of kSpinMaxNs; one that the spin did not end halves it, down to kSpinMinNs,
// and skips the yields once it is below half the maximum. On a quiet machine collectives keep
// the full budget; when peers are often descheduled (more runnable threads than cores), the
// spins fail and waiting becomes sleeping after a few microseconds. The futex wait has a
// timeout, so a dead peer, an abort or the group's timeout is still noticed (every 0.2 s).
namespace {
constexpr int64_t kSpinMaxNs = 200 * 1000;
constexpr int64_t kSpinMinNs = 20 * 1000;
constexpr int64_t kSpinSameCpuNs = 2 * 1000;
constexpr int kYields = 4;

int64_t ns_since(Clock::time_point t0) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t0).count();
}
}  // namespace

void Group::wait_rank(int r, uint32_t value) {
  Ctrl& c = ctrl_[r];
  if (reached(c.seq.load(std::memory_order_acquire), value)) return;
  const bool same_cpu = c.cpu.load(std::memory_order_relaxed) == sched_getcpu();
  const int64_t budget = same_cpu ? kSpinSameCpuNs : spin_ns_;
  const auto spin_start = Clock::now();
  for (uint32_t i = 1;; ++i) {
    DS_PAUSE();
    if (reached(c.seq.load(std::memory_order_acquire), value)) {
      if (!same_cpu) spin_ns_ = std::min(kSpinMaxNs, spin_ns_ + kSpinMaxNs / 8);
      return;
    }
    if ((i & 15) == 0 && ns_since(spin_start) >= budget) break;
  }
  const bool contended = same_cpu || spin_ns_ < kSpinMaxNs / 2;
  if (!same_cpu) spin_ns_ = std::max(kSpinMinNs, spin_ns_ / 2);
  if (!contended) {
    for (int i = 0; i < kYields; ++i) {
      sched_yield();
      if (reached(c.seq.load(std::memory_order_acquire), value)) return;
    }
  }
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(200);
  const timespec tick{0, 100 * 1000 * 1000};
  while (true) {
    // Register first, then look: a signal() after our look sees the registration and wakes
    // us; one before it is seen by the look (both sides use seq_cst: no lost wake-up). And
    // FUTEX_WAIT itself returns at once if the word is no longer `cur`.
    c.waiters.fetch_add(1, std::memory_order_seq_cst);
    uint32_t cur = c.seq.load(std::memory_order_seq_cst);
    if (!reached(cur, value) && header_->aborted.load(std::memory_order_acquire) == 0)
      futex(&c.seq, FUTEX_WAIT, cur, &tick);
    c.waiters.fetch_sub(1, std::memory_order_seq_cst);
    if (reached(c.seq.load(std::memory_order_acquire), value)) return;
    const auto now = Clock::now();
    if (now >= next_check) {
      check_peers({r});
      next_check = now + std::chrono::milliseconds(200);
    }
    if (now - start > timeout_) {
      fail("shm backend: " + std::string(op_label_) + " timed out after " + seconds(timeout_) +
           " s waiting for rank " + std::to_string(r) + " of the group");
    }
  }
}

void Group::wait_all(uint32_t value) {
  for (int r = 0; r < size_; ++r)
    if (r != rank_) wait_rank(r, value);
}

void Group::begin_step() {
  if (!broken_.empty()) throw PeerError(broken_);
  wait_all(prev_first_);
}

void Group::end_step() {
  prev_first_ = cur_first_;
  ++step_;
}

// ---------------------------------------------------------------- collectives

void Group::allreduce(void* buf, size_t count, DType dt, Op op, double premul) {
  if (!broken_.empty()) throw PeerError(broken_);
  const int divisor = op == Op::AVG ? size_ : 1;
  char* data = static_cast<char*>(buf);
  const size_t es = dtype_size(dt);
  if (size_ == 1) {
    const void* srcs[1] = {data};
    if (premul != 1.0) reduce_into(dt, op, data, srcs, 1, count, premul, 1);
    return;
  }
  const size_t chunk = slot_bytes_ / es;
  std::vector<const void*> srcs(size_);
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    char* p = data + off * es;
    begin_step();
    char* mine = slot(step_ & 1, rank_);
    if (n * es <= small_bytes_ || n < static_cast<size_t>(16 * size_)) {
      // One signal: every rank reduces the whole chunk, in rank order (so all agree bit for
      // bit). With two ranks a rank's own term is read in place (out may alias src 0 or 1).
      std::memcpy(mine, p, n * es);
      signal();
      cur_first_ = seq_;
      wait_all(seq_);
      for (int k = 0; k < size_; ++k)
        srcs[k] = (size_ == 2 && k == rank_) ? p : slot(step_ & 1, k);
      reduce_into(dt, op, p, srcs.data(), size_, n, premul, divisor);
    } else {
      // Reduce-scatter then all-gather inside the segment: each rank reduces its 1/n slice.
      const size_t q = round_up((n + size_ - 1) / size_, 16);
      auto lo = [&](int j) { return std::min(n, j * q); };
      auto len = [&](int j) { return std::min(n, (j + 1) * q) - lo(j); };
      if (size_ == 2) {
        const int j = 1 - rank_;
        std::memcpy(mine + lo(j) * es, p + lo(j) * es, len(j) * es);
      } else {
        std::memcpy(mine, p, n * es);
      }
      signal();
      cur_first_ = seq_;
      wait_all(seq_);
      const size_t my_lo = lo(rank_) * es, my_len = len(rank_);
      if (my_len > 0) {
        for (int k = 0; k < size_; ++k)
          srcs[k] = (size_ == 2 && k == rank_) ? p + my_lo : slot(step_ & 1, k) + my_lo;
        reduce_into(dt, op, p + my_lo, srcs.data(), size_, my_len, premul, divisor);
        std::memcpy(mine + my_lo, p + my_lo, my_len * es);
      }
      signal();
      wait_all(seq_);
      for (int j = 0; j < size_; ++j)
        if (j != rank_ && len(j) > 0)
          std::memcpy(p + lo(j) * es, slot(step_ & 1, j) + lo(j) * es, len(j) * es);
    }
    end_step();
  }
}

void Group::broadcast(void* buf, size_t nbytes, int root) {
  if (!broken_.empty()) throw PeerError(broken_);
  if (size_ == 1) return;
  char* data = static_cast<char*>(buf);
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, nbytes - off);
    begin_step();
    char* src = slot(step_ & 1, root);
    if (rank_ == root) std::memcpy(src, data + off, n);
    signal();
    cur_first_ = seq_;
    if (rank_ != root) {
      wait_rank(root, seq_);
      std::memcpy(data + off, src, n);
    }
    end_step();
  }
}

void Group::allgather(const void* in, size_t nbytes, void* const* outs) {
  if (!broken_.empty()) throw PeerError(broken_);
  const char* src = static_cast<const char*>(in);
  if (size_ == 1) {
    if (outs[0] != in) std::memmove(outs[0], in, nbytes);
    return;
  }
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, nbytes - off);
    begin_step();
    std::memcpy(slot(step_ & 1, rank_), src + off, n);
    signal();
    cur_first_ = seq_;
    wait_all(seq_);
    for (int j = 0; j < size_; ++j) {
      char* dst = static_cast<char*>(outs[j]) + off;
      if (j == rank_) {
        if (dst != src + off) std::memmove(dst, src + off, n);
      } else {
        std::memcpy(dst, slot(step_ & 1, j), n);
      }
    }
    end_step();
  }
}

void Group::gather(const void* in, size_t nbytes, void* const* outs, int root) {
  if (!broken_.empty()) throw PeerError(broken_);
  const char* src = static_cast<const char*>(in);
  if (rank_ == root && static_cast<char*>(outs[root]) != src)
    std::memmove(outs[root], src, nbytes);
  if (size_ == 1) return;
  for (size_t off = 0; off < nbytes; off += slot_bytes_) {
    const size_t n = std::min(slot_bytes_, nbytes - off);
    begin_step();
    if (rank_ != root) std::memcpy(slot(step_ & 1, rank_), src + off, n);
    signal();
    cur_first_ = seq_;
    if (rank_ == root) {
      wait_all(seq_);
      for (int j = 0; j < size_; ++j)
        if (j != root) std::memcpy(static_cast<char*>(outs[j]) + off, slot(step_ & 1, j), n);
    }
    end_step();
  }
}

void Group::scatter(const void* const* ins, void* out, size_t nbytes, int root) {
  if (!broken_.empty()) throw PeerError(broken_);
  char* dst = static_cast<char*>(out);
  if (rank_ == root && ins[root] != out) std::memmove(dst, ins[root], nbytes);
  if (size_ == 1) return;
  const size_t sub = slot_bytes_ / size_ / 64 * 64;
  for (size_t off = 0; off < nbytes; off += sub) {
    const size_t n = std::min(sub, nbytes - off);
    begin_step();
    char* s = slot(step_ & 1, root);
    if (rank_ == root)
      for (int j = 0; j < size_; ++j)
        if (j != root) std::memcpy(s + j * sub, static_cast<const char*>(ins[j]) + off, n);
    signal();
    cur_first_ = seq_;
    if (rank_ != root) {
      wait_rank(root, seq_);
      std::memcpy(dst + off, s + rank_ * sub, n);
    }
    end_step();
  }
}

void Group::reduce_scatter(const void* const* ins, void* out, size_t count, DType dt, Op op,
                           double premul) {
  if (!broken_.empty()) throw PeerError(broken_);
  const int divisor = op == Op::AVG ? size_ : 1;
  const size_t es = dtype_size(dt);
  char* dst = static_cast<char*>(out);
  std::vector<const void*> srcs(size_);
  if (size_ == 1) {
    srcs[0] = ins[0];
    reduce_into(dt, op, dst, srcs.data(), 1, count, premul, 1);
    return;
  }
  const size_t c = std::max<size_t>(16, slot_bytes_ / size_ / es / 16 * 16);
  for (size_t off = 0; off < count; off += c) {
    const size_t n = std::min(c, count - off);
    begin_step();
    char* mine = slot(step_ & 1, rank_);
    for (int j = 0; j < size_; ++j)
      if (size_ > 2 || j != rank_)
        std::memcpy(mine + j * c * es, static_cast<const char*>(ins[j]) + off * es, n * es);
    signal();
    cur_first_ = seq_;
    wait_all(seq_);
    for (int k = 0; k < size_; ++k)
      srcs[k] = (size_ == 2 && k == rank_) ? static_cast<const char*>(ins[rank_]) + off * es
                                           : slot(step_ & 1, k) + rank_ * c * es;
    reduce_into(dt, op, dst + off * es, srcs.data(), size_, n, premul, divisor);
    end_step();
  }
}

void Group::alltoall(const void* const* ins, const size_t* in_bytes, void* const* outs,
                     const size_t* out_bytes) {
  if (!broken_.empty()) throw PeerError(broken_);
  if (in_bytes[rank_] != out_bytes[rank_])
    throw std::invalid_argument("shm backend: alltoall sends " +
                                std::to_string(in_bytes[rank_]) + " bytes to itself but expects " +
                                std::to_string(out_bytes[rank_]));
  if (outs[rank_] != ins[rank_]) std::memmove(outs[rank_], ins[rank_], in_bytes[rank_]);
  if (size_ == 1) return;
  // Step 0: every rank publishes its send sizes; each checks what it expects, and all agree on
  // the number of data steps (the largest message over the sub-slot size).
  begin_step();
  auto* sizes = reinterpret_cast<uint64_t*>(slot(step_ & 1, rank_));
  for (int j = 0; j < size_; ++j) sizes[j] = in_bytes[j];
  signal();
  cur_first_ = seq_;
  wait_all(seq_);
  uint64_t largest = 0;
  std::string mismatch;
  for (int j = 0; j < size_; ++j) {
    auto* theirs = reinterpret_cast<const uint64_t*>(slot(step_ & 1, j));
    for (int k = 0; k < size_; ++k) largest = std::max(largest, theirs[k]);
    if (j != rank_ && theirs[rank_] != out_bytes[j] && mismatch.empty())
      mismatch = "shm backend: alltoall: rank " + std::to_string(j) + " sends " +
                 std::to_string(theirs[rank_]) + " bytes to rank " + std::to_string(rank_) +
                 ", which expects " + std::to_string(out_bytes[j]) + " (split sizes disagree)";
  }
  end_step();
  if (!mismatch.empty()) fail(mismatch);
  const size_t sub = slot_bytes_ / size_ / 64 * 64;
  for (size_t off = 0; off < largest; off += sub) {
    begin_step();
    char* mine = slot(step_ & 1, rank_);
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && in_bytes[j] > off)
        std::memcpy(mine + j * sub, static_cast<const char*>(ins[j]) + off,
                    std::min(sub, in_bytes[j] - off));
    signal();
    cur_first_ = seq_;
    wait_all(seq_);
    for (int j = 0; j < size_; ++j)
      if (j != rank_ && out_bytes[j] > off)
        std::memcpy(static_cast<char*>(outs[j]) + off, slot(step_ & 1, j) + rank_ * sub,
                    std::min(sub, out_bytes[j] - off));
    end_step();
  }
}

void Group::barrier() {
  if (!broken_.empty()) throw PeerError(broken_);
  if (size_ == 1) return;
  begin_step();
  signal();
  cur_first_ = seq_;
  wait_all(seq_);
  end_step();
}

// ---------------------------------------------------------------- send / recv

uint64_t Group::post_send(const void* buf, size_t nbytes, int dst, int64_t tag) {
  if (!broken_.empty()) throw PeerError(broken_);
  P2P op{next_id_++, true, dst, const_cast<char*>(static_cast<const char*>(buf)), nbytes, tag};
  uint64_t n64 = nbytes;
  std::memcpy(op.hdr, &n64, 8);
  std::memcpy(op.hdr + 8, &tag, 8);
  sends_[dst].push_back(op);
  pending_.insert(op.id);
  progress();
  return op.id;
}

uint64_t Group::post_recv(void* buf, size_t nbytes, int src, int64_t tag) {
  if (!broken_.empty()) throw PeerError(broken_);
  P2P op{next_id_++, false, src, static_cast<char*>(buf), nbytes, tag};
  recvs_[src].push_back(op);
  pending_.insert(op.id);
  progress();
  return op.id;
}

bool Group::p2p_done(uint64_t id) const { return pending_.count(id) == 0; }

// Moves bytes of `op`'s stream (16-byte header, then payload) through its ring; true when done.
bool Group::progress_one(P2P& op) {
  const size_t total = 16 + op.nbytes;
  Ring* rg = op.send ? ring(rank_, op.peer) : ring(op.peer, rank_);
  char* data = op.send ? ring_data(rank_, op.peer) : ring_data(op.peer, rank_);
  while (op.pos < total) {
    uint64_t w = rg->written.load(std::memory_order_acquire);
    uint64_t r = rg->read.load(std::memory_order_acquire);
    size_t room = op.send ? ring_bytes_ - static_cast<size_t>(w - r) : static_cast<size_t>(w - r);
    if (room == 0) return false;
    // the stream part: header bytes first, then payload; stop at the header's end to check it
    size_t limit = op.pos < 16 ? 16 : total;
    size_t n = std::min(room, limit - op.pos);
    uint64_t at = op.send ? w : r;
    size_t moved = 0;
    while (moved < n) {
      size_t ring_pos = static_cast<size_t>((at + moved) % ring_bytes_);
      size_t piece = std::min(n - moved, ring_bytes_ - ring_pos);
      size_t sp = op.pos + moved;
      char* user = sp < 16 ? reinterpret_cast<char*>(op.hdr) + sp : op.user + (sp - 16);
      if (op.send) std::memcpy(data + ring_pos, user, piece);
      else std::memcpy(user, data + ring_pos, piece);
      moved += piece;
    }
    op.pos += n;
    if (op.send) rg->written.store(w + n, std::memory_order_release);
    else rg->read.store(r + n, std::memory_order_release);
    if (!op.send && op.pos == 16) {
      uint64_t n64;
      int64_t tag;
      std::memcpy(&n64, op.hdr, 8);
      std::memcpy(&tag, op.hdr + 8, 8);
      if (n64 != op.nbytes || tag != op.tag)
        fail("shm backend: recv from rank " + std::to_string(op.peer) + " expected " +
             std::to_string(op.nbytes) + " bytes with tag " + std::to_string(op.tag) +
             " but the next message sent is " + std::to_string(n64) + " bytes with tag " +
             std::to_string(tag) + " (sends and recvs between two ranks must match in order)");
    }
  }
  return true;
}

bool Group::progress() {
  bool moved_any = false;
  for (auto* queues : {&sends_, &recvs_}) {
    for (auto& q : *queues) {
      while (!q.empty()) {
        size_t before = q.front().pos;
        bool done = progress_one(q.front());
        moved_any |= q.front().pos != before;
        if (!done) break;
        pending_.erase(q.front().id);
        q.pop_front();
      }
    }
  }
  return moved_any;
}

void Group::p2p_wait(uint64_t id) {
  if (p2p_done(id)) return;
  const auto start = Clock::now();
  auto next_check = start + std::chrono::milliseconds(200);
  long sleep_ns = 0;
  int idle = 0;
  while (!p2p_done(id)) {
    if (!broken_.empty()) throw PeerError(broken_);
    if (progress()) {
      idle = 0;
      sleep_ns = 0;
      continue;
    }
    if (p2p_done(id)) return;
    ++idle;
    if (idle < 2000) {
      DS_PAUSE();
    } else if (idle < 2100) {
      sched_yield();
    } else {
      sleep_ns = std::min<long>(sleep_ns ? sleep_ns * 2 : 20000, 1000000);
      timespec ts{0, sleep_ns};
      nanosleep(&ts, nullptr);
    }
    const auto now = Clock::now();
    if (now >= next_check) {
      std::vector<int> peers;
      for (int r = 0; r < size_; ++r)
        if (r != rank_ && (!sends_[r].empty() || !recvs_[r].empty())) peers.push_back(r);
      check_peers(peers);
      next_check = now + std::chrono::milliseconds(200);
    }
    if (now - start > timeout_)
      fail("shm backend: " + std::string(op_label_) + " timed out after " + seconds(timeout_) +
           " s");
  }
}

}  // namespace distrun_shm
