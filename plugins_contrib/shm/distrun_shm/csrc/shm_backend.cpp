// torch's c10d::Backend for the shared-memory group: checks and stages tensors, then runs the
// torch-free primitives of shm_group.cpp. Every collective finishes before it returns (its
// Work is complete, with a completed Future holding the outputs); send / recv progress in
// wait(), so batch_isend_irecv's exchanges cannot deadlock.
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <mutex>

#include "shm_group.hpp"

namespace distrun_shm {
namespace {

DType to_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kDouble: return DType::F64;
    case at::kBFloat16: return DType::BF16;
    case at::kHalf: return DType::F16;
    case at::kChar: return DType::I8;
    case at::kShort: return DType::I16;
    case at::kInt: return DType::I32;
    case at::kLong: return DType::I64;
    case at::kByte: return DType::U8;
    case at::kBool: return DType::BOOL;
    default:
      TORCH_CHECK(false, "shm backend: ", op, " does not support dtype ", t.scalar_type(),
                  " (float32, float64, bfloat16, float16, int8/16/32/64, uint8, bool)");
  }
}

Op to_op(const c10d::ReduceOp& rop, double* premul) {
  *premul = 1.0;
  switch (rop.op_) {
    case c10d::ReduceOp::SUM: return Op::SUM;
    case c10d::ReduceOp::AVG: return Op::AVG;
    case c10d::ReduceOp::PRODUCT: return Op::PRODUCT;
    case c10d::ReduceOp::MIN: return Op::MIN;
    case c10d::ReduceOp::MAX: return Op::MAX;
    case c10d::ReduceOp::BAND: return Op::BAND;
    case c10d::ReduceOp::BOR: return Op::BOR;
    case c10d::ReduceOp::BXOR: return Op::BXOR;
    case c10d::ReduceOp::PREMUL_SUM: {
      auto* sup = dynamic_cast<c10d::PreMulSumSupplement*>(rop.supplement_.get());
      TORCH_CHECK(sup != nullptr, "shm backend: PREMUL_SUM without its factor");
      *premul = sup->tensor_factor.defined() ? sup->tensor_factor.item<double>()
                                             : sup->double_factor;
      return Op::PREMUL_SUM;
    }
    default: TORCH_CHECK(false, "shm backend: unknown reduce op ", int(rop.op_));
  }
}

void check_tensor(const at::Tensor& t, const char* op) {
  TORCH_CHECK(t.device().is_cpu(), "shm backend: ", op, " takes CPU tensors, not ", t.device(),
              " (give other devices their own backend: --backend cpu:shm,cuda:nccl)");
  TORCH_CHECK(t.layout() == at::kStrided, "shm backend: ", op,
              " takes dense tensors, not ", t.layout());
}

size_t nbytes(const at::Tensor& t) { return static_cast<size_t>(t.numel()) * t.element_size(); }

// A contiguous tensor to work in: `t` itself, or a copy written back by finish().
struct Staged {
  at::Tensor user, buf;
  explicit Staged(const at::Tensor& t) : user(t), buf(t.is_contiguous() ? t : t.contiguous()) {}
  char* ptr() const { return static_cast<char*>(buf.data_ptr()); }
  void finish() {
    if (!buf.is_same(user)) user.copy_(buf);
  }
};

c10::intrusive_ptr<c10::ivalue::Future> tensor_future() {
  return c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
}

class DoneWork : public c10d::Work {
 public:
  DoneWork(c10d::OpType type, std::vector<at::Tensor> outputs)
      : Work(-1, type), outputs_(std::move(outputs)), future_(tensor_future()) {
    future_->markCompleted(c10::IValue(outputs_));
  }
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  std::vector<at::Tensor> result() override { return outputs_; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
};

class ShmBackend;

class P2PWork : public c10d::Work {
 public:
  P2PWork(c10d::OpType type, c10::intrusive_ptr<ShmBackend> backend, uint64_t id, Staged staged)
      : Work(-1, type), backend_(std::move(backend)), id_(id), staged_(std::move(staged)),
        future_(tensor_future()) {}
  bool isCompleted() override;
  bool isSuccess() const override { return done_; }
  bool wait(std::chrono::milliseconds timeout) override;
  std::vector<at::Tensor> result() override { return {staged_.user}; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }
  void complete() {
    if (done_) return;
    if (type_is_recv()) staged_.finish();
    done_ = true;
    future_->markCompleted(c10::IValue(std::vector<at::Tensor>{staged_.user}));
  }

 private:
  bool type_is_recv() const { return retrieveOpType() == c10d::OpType::RECV; }
  c10::intrusive_ptr<ShmBackend> backend_;
  uint64_t id_;
  Staged staged_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  bool done_ = false;
};

class ShmBackend : public c10d::Backend {
 public:
  ShmBackend(std::unique_ptr<Group> group)
      : Backend(group->rank(), group->size()), group_(std::move(group)) {}

  const std::string getBackendName() const override { return "shm"; }
  void setTimeout(std::chrono::milliseconds t) override { group_->set_timeout(t); }
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>("shm", group_->timeout());
  }
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return seq_; }

  // Runs `body` under the backend's lock, naming the op, turning group failures into
  // torch's distributed errors.
  template <typename F>
  void guarded(const char* op, F&& body) {
    std::lock_guard<std::mutex> lock(mu_);
    ++seq_;
    group_->set_op(op);
    try {
      body();
    } catch (const PeerError& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    } catch (const std::invalid_argument& e) {
      C10_THROW_ERROR(ValueError, e.what());
    }
  }

  void reduce_one(const at::Tensor& t, const c10d::ReduceOp& rop, const char* op) {
    check_tensor(t, op);
    DType dt = to_dtype(t, op);
    double premul;
    Op o = to_op(rop, &premul);
    std::string why;
    TORCH_CHECK(op_supported(dt, o, &why), "shm backend: ", op, ": ", why);
    Staged s(t);
    group_->allreduce(s.ptr(), t.numel(), dt, o, premul);
    s.finish();
  }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override {
    guarded("allreduce", [&] {
      for (auto& t : tensors) reduce_one(t, opts.reduceOp, "allreduce");
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLREDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    guarded("allreduce_coalesced", [&] {
      for (auto& t : tensors) reduce_one(t, opts.reduceOp, "allreduce_coalesced");
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLREDUCE_COALESCED, tensors);
  }

  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override {
    // An all-reduce whose result only the root keeps (the others reduce into a copy).
    guarded("reduce", [&] {
      for (auto& t : tensors) {
        if (getRank() == opts.rootRank) {
          reduce_one(t, opts.reduceOp, "reduce");
        } else {
          at::Tensor tmp = t.clone(at::MemoryFormat::Contiguous);
          reduce_one(tmp, opts.reduceOp, "reduce");
        }
      }
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::REDUCE, tensors);
  }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override {
    guarded("broadcast", [&] {
      for (auto& t : tensors) {
        check_tensor(t, "broadcast");
        Staged s(t);
        group_->broadcast(s.ptr(), nbytes(t), static_cast<int>(opts.rootRank));
        if (getRank() != opts.rootRank) s.finish();
      }
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::BROADCAST, tensors);
  }

  // outputs[j] receives rank j's input; all the same size and dtype.
  void allgather_list(std::vector<at::Tensor>& outputs, const at::Tensor& input, const char* op) {
    check_tensor(input, op);
    TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "shm backend: ", op,
                " needs one output tensor per rank (", getSize(), "), got ", outputs.size());
    std::vector<Staged> outs;
    std::vector<void*> ptrs;
    for (auto& o : outputs) {
      check_tensor(o, op);
      TORCH_CHECK(o.scalar_type() == input.scalar_type() && o.numel() == input.numel(),
                  "shm backend: ", op, ": output tensors must match the input's dtype and size (",
                  input.scalar_type(), ", ", input.numel(), " elements)");
      outs.emplace_back(o);
    }
    for (auto& s : outs) ptrs.push_back(s.ptr());
    Staged in(input);
    group_->allgather(in.ptr(), nbytes(input), ptrs.data());
    for (auto& s : outs) s.finish();
  }

  void allgather_flat(at::Tensor& output, const at::Tensor& input, const char* op) {
    check_tensor(input, op);
    check_tensor(output, op);
    TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                    output.numel() == input.numel() * getSize(),
                "shm backend: ", op, ": the output must hold world_size x the input (",
                input.numel() * getSize(), " elements of ", input.scalar_type(), "), got ",
                output.numel(), " of ", output.scalar_type());
    Staged out(output);
    Staged in(input);
    std::vector<void*> ptrs;
    for (int j = 0; j < getSize(); ++j) ptrs.push_back(out.ptr() + j * nbytes(input));
    group_->allgather(in.ptr(), nbytes(input), ptrs.data());
    out.finish();
  }

  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& /*opts*/) override {
    guarded("allgather", [&] {
      TORCH_CHECK(outputs.size() == inputs.size(), "shm backend: allgather: one output list "
                  "per input tensor");
      for (size_t i = 0; i < inputs.size(); ++i) allgather_list(outputs[i], inputs[i], "allgather");
    });
    std::vector<at::Tensor> flat;
    for (auto& l : outputs) flat.insert(flat.end(), l.begin(), l.end());
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLGATHER, flat);
  }

  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override {
    guarded("allgather_coalesced", [&] {
      for (size_t i = 0; i < inputs.size(); ++i)
        allgather_list(outputs[i], inputs[i], "allgather_coalesced");
    });
    std::vector<at::Tensor> flat;
    for (auto& l : outputs) flat.insert(flat.end(), l.begin(), l.end());
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLGATHER_COALESCED, flat);
  }

  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& /*opts*/) override {
    guarded("_allgather_base", [&] { allgather_flat(output, input, "_allgather_base"); });
    return c10::make_intrusive<DoneWork>(c10d::OpType::_ALLGATHER_BASE,
                                         std::vector<at::Tensor>{output});
  }

  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& /*opts*/) override {
    guarded("allgather_into_tensor_coalesced", [&] {
      TORCH_CHECK(outputs.size() == inputs.size(), "shm backend: "
                  "allgather_into_tensor_coalesced: one output per input");
      for (size_t i = 0; i < inputs.size(); ++i)
        allgather_flat(outputs[i], inputs[i], "allgather_into_tensor_coalesced");
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::COALESCED, outputs);
  }

  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override {
    guarded("gather", [&] {
      TORCH_CHECK(inputs.size() == 1, "shm backend: gather takes one input tensor");
      const at::Tensor& input = inputs[0];
      check_tensor(input, "gather");
      Staged in(input);
      const int root = static_cast<int>(opts.rootRank);
      std::vector<Staged> outs;
      std::vector<void*> ptrs(getSize(), nullptr);
      if (getRank() == root) {
        TORCH_CHECK(outputs.size() == 1 && static_cast<int>(outputs[0].size()) == getSize(),
                    "shm backend: gather needs one output tensor per rank on the root");
        for (auto& o : outputs[0]) {
          TORCH_CHECK(o.scalar_type() == input.scalar_type() && o.numel() == input.numel(),
                      "shm backend: gather: outputs must match the input's dtype and size");
          outs.emplace_back(o);
        }
        for (int j = 0; j < getSize(); ++j) ptrs[j] = outs[j].ptr();
      }
      group_->gather(in.ptr(), nbytes(input), ptrs.data(), root);
      for (auto& s : outs) s.finish();
    });
    return c10::make_intrusive<DoneWork>(
        c10d::OpType::GATHER, outputs.empty() ? std::vector<at::Tensor>{} : outputs[0]);
  }

  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override {
    guarded("scatter", [&] {
      TORCH_CHECK(outputs.size() == 1, "shm backend: scatter takes one output tensor");
      at::Tensor& output = outputs[0];
      check_tensor(output, "scatter");
      const int root = static_cast<int>(opts.rootRank);
      std::vector<at::Tensor> ins;
      std::vector<const void*> ptrs(getSize(), nullptr);
      if (getRank() == root) {
        TORCH_CHECK(inputs.size() == 1 && static_cast<int>(inputs[0].size()) == getSize(),
                    "shm backend: scatter needs one input tensor per rank on the root");
        for (auto& i : inputs[0]) {
          TORCH_CHECK(i.scalar_type() == output.scalar_type() && i.numel() == output.numel(),
                      "shm backend: scatter: inputs must match the output's dtype and size");
          ins.push_back(i.contiguous());
        }
        for (int j = 0; j < getSize(); ++j) ptrs[j] = ins[j].data_ptr();
      }
      Staged out(output);
      group_->scatter(ptrs.data(), out.ptr(), nbytes(output), root);
      out.finish();
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::SCATTER, outputs);
  }

  void reduce_scatter_ptrs(const std::vector<const void*>& ins, at::Tensor& output,
                           const c10d::ReduceOp& rop, const char* op) {
    DType dt = to_dtype(output, op);
    double premul;
    Op o = to_op(rop, &premul);
    std::string why;
    TORCH_CHECK(op_supported(dt, o, &why), "shm backend: ", op, ": ", why);
    Staged out(output);
    group_->reduce_scatter(ins.data(), out.ptr(), output.numel(), dt, o, premul);
    out.finish();
  }

  void reduce_scatter_flat(at::Tensor& output, const at::Tensor& input,
                           const c10d::ReduceOp& rop, const char* op) {
    check_tensor(input, op);
    check_tensor(output, op);
    TORCH_CHECK(output.scalar_type() == input.scalar_type() &&
                    input.numel() == output.numel() * getSize(),
                "shm backend: ", op, ": the input must hold world_size x the output (",
                output.numel() * getSize(), " elements of ", output.scalar_type(), "), got ",
                input.numel(), " of ", input.scalar_type());
    at::Tensor in = input.contiguous();
    std::vector<const void*> ptrs;
    for (int j = 0; j < getSize(); ++j)
      ptrs.push_back(static_cast<const char*>(in.data_ptr()) + j * nbytes(output));
    reduce_scatter_ptrs(ptrs, output, rop, op);
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override {
    guarded("reduce_scatter", [&] {
      TORCH_CHECK(outputs.size() == 1 && inputs.size() == 1 &&
                      static_cast<int>(inputs[0].size()) == getSize(),
                  "shm backend: reduce_scatter takes one output and one input per rank");
      at::Tensor& output = outputs[0];
      check_tensor(output, "reduce_scatter");
      std::vector<at::Tensor> ins;
      std::vector<const void*> ptrs;
      for (auto& i : inputs[0]) {
        check_tensor(i, "reduce_scatter");
        TORCH_CHECK(i.scalar_type() == output.scalar_type() && i.numel() == output.numel(),
                    "shm backend: reduce_scatter: inputs must match the output's dtype and size");
        ins.push_back(i.contiguous());
        ptrs.push_back(ins.back().data_ptr());
      }
      reduce_scatter_ptrs(ptrs, output, opts.reduceOp, "reduce_scatter");
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::REDUCE_SCATTER, outputs);
  }

  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    guarded("_reduce_scatter_base",
            [&] { reduce_scatter_flat(output, input, opts.reduceOp, "_reduce_scatter_base"); });
    return c10::make_intrusive<DoneWork>(c10d::OpType::_REDUCE_SCATTER_BASE,
                                         std::vector<at::Tensor>{output});
  }

  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override {
    guarded("reduce_scatter_tensor_coalesced", [&] {
      TORCH_CHECK(outputs.size() == inputs.size(), "shm backend: "
                  "reduce_scatter_tensor_coalesced: one output per input");
      for (size_t i = 0; i < inputs.size(); ++i)
        reduce_scatter_flat(outputs[i], inputs[i], opts.reduceOp,
                            "reduce_scatter_tensor_coalesced");
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::COALESCED, outputs);
  }

  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& outSplits,
                                               std::vector<int64_t>& inSplits,
                                               const c10d::AllToAllOptions& /*opts*/) override {
    guarded("alltoall_base", [&] {
      check_tensor(input, "alltoall_base");
      check_tensor(output, "alltoall_base");
      TORCH_CHECK(input.scalar_type() == output.scalar_type(),
                  "shm backend: alltoall_base: input and output dtypes differ");
      const int n = getSize();
      auto plan = [&](const at::Tensor& t, const std::vector<int64_t>& splits,
                      std::vector<size_t>& bytes, std::vector<size_t>& offs) {
        const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
        const size_t row_bytes = rows == 0 ? 0 : nbytes(t) / rows;
        if (splits.empty()) {
          TORCH_CHECK(rows % n == 0, "shm backend: alltoall_base: dim 0 (", rows,
                      ") must divide by the group size ", n, " without split sizes");
        } else {
          TORCH_CHECK(static_cast<int>(splits.size()) == n, "shm backend: alltoall_base: ",
                      "one split size per rank (", n, "), got ", splits.size());
        }
        size_t off = 0;
        int64_t total = 0;
        for (int j = 0; j < n; ++j) {
          int64_t r = splits.empty() ? rows / n : splits[j];
          total += r;
          bytes.push_back(r * row_bytes);
          offs.push_back(off);
          off += r * row_bytes;
        }
        TORCH_CHECK(total == rows, "shm backend: alltoall_base: split sizes add up to ", total,
                    ", not dim 0 (", rows, ")");
      };
      std::vector<size_t> in_bytes, in_offs, out_bytes, out_offs;
      plan(input, inSplits, in_bytes, in_offs);
      plan(output, outSplits, out_bytes, out_offs);
      Staged in(input), out(output);
      std::vector<const void*> ins;
      std::vector<void*> outs;
      for (int j = 0; j < n; ++j) {
        ins.push_back(in.ptr() + in_offs[j]);
        outs.push_back(out.ptr() + out_offs[j]);
      }
      group_->alltoall(ins.data(), in_bytes.data(), outs.data(), out_bytes.data());
      out.finish();
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLTOALL_BASE,
                                         std::vector<at::Tensor>{output});
  }

  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& /*opts*/) override {
    guarded("alltoall", [&] {
      const int n = getSize();
      TORCH_CHECK(static_cast<int>(outputs.size()) == n && static_cast<int>(inputs.size()) == n,
                  "shm backend: alltoall needs one input and one output tensor per rank");
      std::vector<Staged> ins, outs;
      std::vector<const void*> in_ptrs;
      std::vector<void*> out_ptrs;
      std::vector<size_t> in_bytes, out_bytes;
      for (int j = 0; j < n; ++j) {
        check_tensor(inputs[j], "alltoall");
        check_tensor(outputs[j], "alltoall");
        ins.emplace_back(inputs[j]);
        outs.emplace_back(outputs[j]);
        in_bytes.push_back(nbytes(inputs[j]));
        out_bytes.push_back(nbytes(outputs[j]));
      }
      for (int j = 0; j < n; ++j) {
        in_ptrs.push_back(ins[j].ptr());
        out_ptrs.push_back(outs[j].ptr());
      }
      group_->alltoall(in_ptrs.data(), in_bytes.data(), out_ptrs.data(), out_bytes.data());
      for (auto& s : outs) s.finish();
    });
    return c10::make_intrusive<DoneWork>(c10d::OpType::ALLTOALL, outputs);
  }

  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& /*opts*/) override {
    guarded("barrier", [&] { group_->barrier(); });
    return c10::make_intrusive<DoneWork>(c10d::OpType::BARRIER, std::vector<at::Tensor>{});
  }

  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst,
                                      int tag) override {
    TORCH_CHECK(tensors.size() == 1, "shm backend: send takes one tensor");
    check_tensor(tensors[0], "send");
    TORCH_CHECK(dst != getRank(), "shm backend: a rank cannot send to itself");
    Staged s(tensors[0]);
    uint64_t id = 0;
    guarded("send", [&] { id = group_->post_send(s.ptr(), nbytes(s.buf), dst, tag); });
    auto work = c10::make_intrusive<P2PWork>(c10d::OpType::SEND,
                                             c10::intrusive_ptr<ShmBackend>::reclaim_copy(this),
                                             id, std::move(s));
    if (p2p_done(id)) work->complete();
    return work;
  }

  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src,
                                      int tag) override {
    TORCH_CHECK(tensors.size() == 1, "shm backend: recv takes one tensor");
    check_tensor(tensors[0], "recv");
    TORCH_CHECK(src != getRank(), "shm backend: a rank cannot receive from itself");
    Staged s(tensors[0]);
    uint64_t id = 0;
    guarded("recv", [&] { id = group_->post_recv(s.ptr(), nbytes(s.buf), src, tag); });
    auto work = c10::make_intrusive<P2PWork>(c10d::OpType::RECV,
                                             c10::intrusive_ptr<ShmBackend>::reclaim_copy(this),
                                             id, std::move(s));
    if (p2p_done(id)) work->complete();
    return work;
  }

  bool p2p_done(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    return group_->p2p_done(id);
  }
  void p2p_wait(uint64_t id, const char* op) {
    guarded(op, [&] { group_->p2p_wait(id); });
  }
  bool p2p_poll(uint64_t id, const char* op) {
    bool done = false;
    guarded(op, [&] {
      group_->p2p_poll();
      done = group_->p2p_done(id);
    });
    return done;
  }

 private:
  std::unique_ptr<Group> group_;
  std::mutex mu_;
  uint64_t seq_ = 0;
};

bool P2PWork::isCompleted() {
  if (!done_ && backend_->p2p_poll(id_, type_is_recv() ? "recv" : "send")) complete();
  return done_;
}

bool P2PWork::wait(std::chrono::milliseconds /*timeout*/) {
  if (!done_) {
    backend_->p2p_wait(id_, type_is_recv() ? "recv" : "send");
    complete();
  }
  return true;
}

c10::intrusive_ptr<c10d::Backend> create(int rank, int size, const std::string& name,
                                         bool create_segment, std::vector<int64_t> pids,
                                         int64_t slot_bytes, int64_t ring_bytes,
                                         int64_t small_bytes, double timeout_s) {
  auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000));
  std::unique_ptr<Group> group;
  try {
    group = std::make_unique<Group>(name, create_segment, rank, size, slot_bytes, ring_bytes,
                                    timeout, std::move(pids));
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, e.what());
  }
  group->set_small_bytes(static_cast<size_t>(small_bytes));
  return c10::make_intrusive<ShmBackend>(std::move(group));
}

}  // namespace
}  // namespace distrun_shm

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "distrun-shm: the shared-memory c10d backend (built by distrun_shm.build)";
  m.def("create", &distrun_shm::create, "make this rank's backend on segment `name`",
        py::arg("rank"), py::arg("size"), py::arg("name"), py::arg("create"), py::arg("pids"),
        py::arg("slot_bytes"), py::arg("ring_bytes"), py::arg("small_bytes"),
        py::arg("timeout_s"));
  m.def("unlink", &distrun_shm::Group::unlink, "remove a segment's name from /dev/shm");
  m.def("segment_bytes", &distrun_shm::Group::segment_bytes);
}
