// Element-wise reductions for the shared-memory collectives.
//
// Plain loops over blocks that gcc vectorises at -O3. Each dtype's entry point is compiled
// twice (target_clones): for x86-64-v3 (AVX2, FMA, F16C) and for the baseline, picked at load
// time by the CPU it runs on, so the library never needs -march=native. FP contraction is off
// (setup flags), so a sum is the sum a reference computes, term by term.
#include <algorithm>
#include <cstring>
#include <type_traits>

#include "shm_group.hpp"

namespace distrun_shm {

size_t dtype_size(DType dt) {
  switch (dt) {
    case DType::F64: case DType::I64: return 8;
    case DType::F32: case DType::I32: return 4;
    case DType::BF16: case DType::F16: case DType::I16: return 2;
    default: return 1;
  }
}

const char* dtype_name(DType dt) {
  static const char* names[] = {"float32", "float64", "bfloat16", "float16", "int8",
                                "int16", "int32", "int64", "uint8", "bool"};
  return names[static_cast<int>(dt)];
}

const char* op_name(Op op) {
  static const char* names[] = {"SUM", "AVG", "MIN", "MAX", "PRODUCT", "BAND", "BOR", "BXOR",
                                "PREMUL_SUM"};
  return names[static_cast<int>(op)];
}

bool op_supported(DType dt, Op op, std::string* why) {
  bool floating = dt == DType::F32 || dt == DType::F64 || dt == DType::BF16 || dt == DType::F16;
  bool bitwise = op == Op::BAND || op == Op::BOR || op == Op::BXOR;
  if (floating && bitwise) {
    *why = std::string(op_name(op)) + " is not defined on " + dtype_name(dt);
    return false;
  }
  if (!floating && op == Op::PREMUL_SUM) {
    *why = std::string("PREMUL_SUM needs a floating dtype, not ") + dtype_name(dt);
    return false;
  }
  if (dt == DType::BOOL && op == Op::AVG) {
    *why = "AVG is not defined on bool";
    return false;
  }
  return true;
}

namespace {

#define DS_INLINE inline __attribute__((always_inline))

struct BF16 { uint16_t bits; };

DS_INLINE float load(BF16 v) {
  uint32_t u = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
DS_INLINE BF16 store_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  // round to nearest even, NaN stays a (quiet) NaN: the rounding torch's BFloat16 uses
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return BF16{static_cast<uint16_t>(f != f ? 0x7FC0u : rounded)};
}
DS_INLINE float load(_Float16 v) { return static_cast<float>(v); }
template <typename T> DS_INLINE T load(T v) { return v; }

template <typename S> struct Acc { using type = S; };
template <> struct Acc<BF16> { using type = float; };
template <> struct Acc<_Float16> { using type = float; };

template <typename S, typename A> DS_INLINE S store(A a) {
  if constexpr (std::is_same_v<S, BF16>) return store_bf16(a);
  else return static_cast<S>(a);
}

template <typename A> DS_INLINE A wrap_add(A x, A y) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(x) + static_cast<U>(y));
  } else {
    return x + y;
  }
}
template <typename A> DS_INLINE A wrap_mul(A x, A y) {
  if constexpr (std::is_integral_v<A>) {
    using U = std::make_unsigned_t<A>;
    return static_cast<A>(static_cast<U>(x) * static_cast<U>(y));
  } else {
    return x * y;
  }
}

struct FSum { template <typename A> DS_INLINE A operator()(A x, A y) const { return wrap_add(x, y); } };
struct FProd { template <typename A> DS_INLINE A operator()(A x, A y) const { return wrap_mul(x, y); } };
struct FMin { template <typename A> DS_INLINE A operator()(A x, A y) const { return y < x ? y : x; } };
struct FMax { template <typename A> DS_INLINE A operator()(A x, A y) const { return x < y ? y : x; } };
struct FAnd { template <typename A> DS_INLINE A operator()(A x, A y) const { return x & y; } };
struct FOr { template <typename A> DS_INLINE A operator()(A x, A y) const { return x | y; } };
struct FXor { template <typename A> DS_INLINE A operator()(A x, A y) const { return x ^ y; } };

constexpr size_t kBlock = 1024;

// out = op over srcs, block by block so the accumulator stays in L1; out may alias src 0/1.
template <typename S, typename F>
DS_INLINE void run(S* out, const S* const* src, int nsrc, size_t n, F f, double premul,
                   int divisor) {
  using A = typename Acc<S>::type;
  A acc[kBlock];
  const A pm = static_cast<A>(premul);
  for (size_t i0 = 0; i0 < n; i0 += kBlock) {
    const size_t m = std::min(kBlock, n - i0);
    const S* a = src[0] + i0;
    if (nsrc == 1) {
      for (size_t i = 0; i < m; ++i) acc[i] = load(a[i]);
      if constexpr (std::is_floating_point_v<A>)
        if (premul != 1.0)
          for (size_t i = 0; i < m; ++i) acc[i] = acc[i] * pm;
    } else {
      const S* b = src[1] + i0;
      if (premul != 1.0) {
        if constexpr (std::is_floating_point_v<A>)
          for (size_t i = 0; i < m; ++i) acc[i] = f(load(a[i]) * pm, load(b[i]) * pm);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = f(static_cast<A>(load(a[i])), static_cast<A>(load(b[i])));
      }
    }
    for (int k = 2; k < nsrc; ++k) {
      const S* c = src[k] + i0;
      if (premul != 1.0) {
        if constexpr (std::is_floating_point_v<A>)
          for (size_t i = 0; i < m; ++i) acc[i] = f(acc[i], load(c[i]) * pm);
      } else {
        for (size_t i = 0; i < m; ++i) acc[i] = f(acc[i], static_cast<A>(load(c[i])));
      }
    }
    if (divisor > 1) {
      const A d = static_cast<A>(divisor);
      for (size_t i = 0; i < m; ++i) acc[i] = acc[i] / d;
    }
    S* o = out + i0;
    for (size_t i = 0; i < m; ++i) o[i] = store<S, A>(acc[i]);
  }
}

template <typename S>
DS_INLINE void dispatch_op(Op op, void* out, const void* const* srcs, int nsrc, size_t n,
                           double premul, int divisor) {
  auto* o = static_cast<S*>(out);
  auto* s = reinterpret_cast<const S* const*>(srcs);
  using A = typename Acc<S>::type;
  switch (op) {
    case Op::SUM: case Op::PREMUL_SUM: return run(o, s, nsrc, n, FSum{}, premul, 1);
    case Op::AVG: return run(o, s, nsrc, n, FSum{}, 1.0, divisor);
    case Op::PRODUCT: return run(o, s, nsrc, n, FProd{}, 1.0, 1);
    case Op::MIN: return run(o, s, nsrc, n, FMin{}, 1.0, 1);
    case Op::MAX: return run(o, s, nsrc, n, FMax{}, 1.0, 1);
    default: break;
  }
  if constexpr (std::is_integral_v<A>) {
    switch (op) {
      case Op::BAND: return run(o, s, nsrc, n, FAnd{}, 1.0, 1);
      case Op::BOR: return run(o, s, nsrc, n, FOr{}, 1.0, 1);
      case Op::BXOR: return run(o, s, nsrc, n, FXor{}, 1.0, 1);
      default: break;
    }
  }
}

#define DS_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#define DS_ENTRY(fname, S)                                                                  \
  DS_CLONES void fname(Op op, void* out, const void* const* srcs, int nsrc, size_t n,       \
                       double premul, int divisor) {                                        \
    dispatch_op<S>(op, out, srcs, nsrc, n, premul, divisor);                                \
  }

DS_ENTRY(reduce_f32, float)
DS_ENTRY(reduce_f64, double)
DS_ENTRY(reduce_bf16, BF16)
DS_ENTRY(reduce_f16, _Float16)
DS_ENTRY(reduce_i8, int8_t)
DS_ENTRY(reduce_i16, int16_t)
DS_ENTRY(reduce_i32, int32_t)
DS_ENTRY(reduce_i64, int64_t)
DS_ENTRY(reduce_u8, uint8_t)

}  // namespace

void reduce_into(DType dt, Op op, void* out, const void* const* srcs, int nsrc, size_t count,
                 double premul, int divisor) {
  if (dt == DType::BOOL) {  // bytes 0/1: sum = or, product = and (torch's bool semantics)
    if (op == Op::SUM || op == Op::MAX) op = Op::BOR;
    else if (op == Op::PRODUCT || op == Op::MIN) op = Op::BAND;
    dt = DType::U8;
  }
  switch (dt) {
    case DType::F32: return reduce_f32(op, out, srcs, nsrc, count, premul, divisor);
    case DType::F64: return reduce_f64(op, out, srcs, nsrc, count, premul, divisor);
    case DType::BF16: return reduce_bf16(op, out, srcs, nsrc, count, premul, divisor);
    case DType::F16: return reduce_f16(op, out, srcs, nsrc, count, premul, divisor);
    case DType::I8: return reduce_i8(op, out, srcs, nsrc, count, premul, divisor);
    case DType::I16: return reduce_i16(op, out, srcs, nsrc, count, premul, divisor);
    case DType::I32: return reduce_i32(op, out, srcs, nsrc, count, premul, divisor);
    case DType::I64: return reduce_i64(op, out, srcs, nsrc, count, premul, divisor);
    default: return reduce_u8(op, out, srcs, nsrc, count, premul, divisor);
  }
}

}  // namespace distrun_shm
