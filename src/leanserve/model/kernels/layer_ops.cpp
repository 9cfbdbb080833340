// The elementwise work between a decoder layer's GEMMs, for the CPU: RMS norm (with the residual
// add before it, in place), the rotary embedding (in place), SiLU(gate) * up. Each is one pass
// over its rows, in float32 registers.
//
// Why it exists (bench/results/model.md): eager PyTorch runs these as ~60 small ops a layer (on
// the CPU ATen composes rms_norm of ~34, six dtype conversions among them), each a dispatch and
// a pass over memory, and each rounds to bf16; in a batch-1 decode step of the default model
// they cost about as much as a third of its GEMMs.
//
// Numerics follow Hugging Face's modules, which the tests compare against: float32 arithmetic,
// rounded to the tensor's dtype where their bf16 ops round (the normalised row before the
// weight and the product after it; SiLU's output and the product with up; each product of the
// rotation and their sum). Rows are independent: a row's result never depends on the batch.
//
// Built at run time by leanserve/model/kernels/__init__.py, like paged_decode_attention.cpp, but
// with -ffp-contract=off: products are rounded where torch's ops round them, never fused with the
// sum after them into an FMA, so the rotary embedding is bitwise transformers' in float32 too
// (tested); and on x86 with -mprefer-vector-width=512, so GCC vectorises these loops in AVX-512's
// 16 lanes where the CPU has them, not the 8 it prefers (1.2-1.6x a call at 64-192 rows; the
// numbers at the flags in kernels/__init__.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

using leanserve::exp_nonpositive;
using leanserve::for_dtype;
using leanserve::narrow;
using leanserve::widen;

// Rows per task: at least this many elements each, so a decode step's few rows stay on the
// calling thread (waking the pool costs more than the work) and a prefill chunk's are spread.
constexpr int64_t kElementsPerTask = 1 << 15;

inline int64_t grain(int64_t row_elements) {
  return std::max<int64_t>(1, kElementsPerTask / std::max<int64_t>(row_elements, 1));
}

template <typename T>
inline void normalise_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += widen(x[i]) * widen(x[i]);
  const float inv_rms = 1.f / std::sqrt(squares / float(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = narrow<T>(widen(narrow<T>(widen(x[i]) * inv_rms)) * widen(weight[i]));
}

void check_norm(const char* op, const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.dim() == 1 && weight.is_contiguous() &&
                  x.dim() >= 1 && x.size(-1) == weight.size(0),
              op, ": weight [", x.size(-1), "], contiguous, of the input's dtype");
}

// RMSNorm(x) * weight over the last dimension, x of any layout: a new tensor.
at::Tensor rms_norm(const at::Tensor& x_any, const at::Tensor& weight, double eps) {
  check_norm("rms_norm", x_any, weight);
  const at::Tensor x = x_any.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1), rows = n ? x.numel() / n : 0;
  for_dtype(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    const T *src = x.const_data_ptr<T>(), *w = weight.const_data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) normalise_row(src + r * n, w, dst + r * n, n, float(eps));
    });
  });
  return out;
}

// residual += x (rounded to the dtype, as a bf16 add rounds), then x = RMSNorm(residual) * weight:
// both in place, both [rows, hidden] contiguous. The residual stream of a pre-norm decoder.
void add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm("add_rms_norm", x, weight);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: x and residual [rows, hidden], contiguous, of one dtype");
  const int64_t rows = x.size(0), n = x.size(1);
  for_dtype(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    T *xs = x.data_ptr<T>(), *res = residual.data_ptr<T>();
    const T* w = weight.const_data_ptr<T>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        T *xr = xs + r * n, *rr = res + r * n;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) rr[i] = narrow<T>(widen(xr[i]) + widen(rr[i]));
        normalise_row(rr, w, xr, n, float(eps));
      }
    });
  });
}

// Rotary embedding, half-split layout (GPT-NeoX / Hugging Face), in place on x [tokens, heads,
// dim] (the last dimension contiguous, the others of any stride: q and k heads inside the fused
// QKV output). cos, sin: [tokens, dim / 2], x's dtype, the factors of each token's position.
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0,
              "rotary_: x [tokens, heads, dim] with dim even and contiguous");
  const int64_t tokens = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes() &&
                  cos.size(0) == tokens && cos.size(1) == half && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary_: cos and sin [tokens, dim / 2], contiguous, of x's dtype");
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  for_dtype(x.scalar_type(), "rotary_", [&](auto tag) {
    using T = decltype(tag);
    T* base = x.data_ptr<T>();
    const T *cs = cos.const_data_ptr<T>(), *sn = sin.const_data_ptr<T>();
    at::parallel_for(0, tokens, grain(heads * 2 * half), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T *c = cs + t * half, *s = sn + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          T *x1 = base + t * token_stride + h * head_stride, *x2 = x1 + half;
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float a = widen(x1[i]), b = widen(x2[i]), ci = widen(c[i]), si = widen(s[i]);
            x1[i] = narrow<T>(widen(narrow<T>(a * ci)) - widen(narrow<T>(b * si)));
            x2[i] = narrow<T>(widen(narrow<T>(b * ci)) + widen(narrow<T>(a * si)));
          }
        }
      }
    });
  });
}

// SiLU(gate) * up for gate_up = [gate | up] of [rows, 2 * inter]: a new [rows, inter] tensor.
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_and_mul: gate_up [rows, 2 * inter], contiguous");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  for_dtype(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* src = gate_up.const_data_ptr<T>();
    T* dst = out.data_ptr<T>();
    at::parallel_for(0, rows, grain(2 * inter), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const T *gate = src + r * 2 * inter, *up = gate + inter;
        T* o = dst + r * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
          // sigmoid(g) from exp(-|g|) <= 1: no overflow on either side.
          const float g = widen(gate[i]), e = exp_nonpositive(-std::fabs(g));
          const float sigmoid = (g >= 0.f ? 1.f : e) / (1.f + e);
          o[i] = narrow<T>(widen(narrow<T>(g * sigmoid)) * widen(up[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leanserve, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(leanserve, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
