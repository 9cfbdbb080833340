// Decode attention over the paged KV cache, for the CPU: one query token per sequence against
// the keys and values of its own blocks, read where they lie in the cache (no gather, no
// padding to the longest context), with all query heads that share a KV head in one pass, so
// each key and value row is read from memory once and used G times.
//
// Why it exists (bench/results/model.md): SDPA's flash kernel over gathered keys tiles a decode
// row's G = 3 query heads (the default model) as 3-row tiles, ~29 GFLOP/s here, and the gather
// copies every key first. This kernel keeps a KV head's G queries and G running sums in
// registers and streams the blocks through them: one layer of 64 rows x 1,024 tokens, 3.3 ms
// against 8.7-12 ms gathered into SDPA (AMD EPYC, 2 threads).
//
// Numerics: scores, softmax and the weighted sum in float32 with an online (running max)
// softmax, the result rounded once to the cache's dtype. A row's result depends only on its
// own query and context: contexts are cut into partitions of a fixed number of tokens
// (kPartitionTokens, not a function of the batch or the threads), each attended on its own and
// merged in order, so the output is bitwise the same whatever rows share the step (batch
// invariance, tested).
//
// Built at run time by leanserve/model/kernels/__init__.py (g++ -O3 -march=native -fopenmp,
// linked against the libgomp torch loaded, so its threads are torch's).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "common.h"

namespace {

using leanserve::exp_nonpositive;
using leanserve::for_dtype;
using leanserve::widen;

// Tokens a work item attends: long contexts split into partitions so that few rows still keep
// every thread busy; fixed, so a row's partitions (and its result) do not depend on the batch.
constexpr int64_t kPartitionTokens = 256;
constexpr int64_t kMaxHeads = 128;  // query heads
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlockSize = 256;

template <typename T>
inline void widen_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = widen(src[i]);
}

// Float vectors as the compiler's own vector type: 16 lanes, one AVX-512 register, two AVX2 or
// four NEON ones where the CPU has narrower registers. The shapes most models have (below) keep
// a KV head's query heads and their sums in registers across a whole partition.
constexpr int kLanes = 16;
typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline float sum_lanes(vfloat v) {  // halves added: 4 shuffles and adds, not 15 dependent adds
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// Folds one query head's scores for a block, s[0, n), into its running max and sum: s becomes the
// block's weights exp(s - max). Returns the factor the head's weighted sum of values so far must
// be scaled by: 0 for the first block (the max was -inf), 1 where the max held.
inline float fold_block_scores(float* s, int64_t n, float& max, float& sum) {
  float m = max;
  for (int64_t t = 0; t < n; ++t) m = std::max(m, s[t]);
  const float rescale = exp_nonpositive(max - m);
  float total = 0.f;
  for (int64_t t = 0; t < n; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    total += s[t];
  }
  sum = sum * rescale + total;
  max = m;
  return rescale;
}

// Running state of one (row, partition): per query head the max score so far, the sum of
// exp(score - max), and the exp-weighted sum of values, all float32.
struct Partial {
  float* max;  // [H]
  float* sum;  // [H]
  float* acc;  // [H, D]
};

// Asks for the cache lines of ``elements`` keys or values from p into L2. Blocks lie anywhere in
// the pool, so the hardware prefetcher cannot see the next one coming: without this the kernel
// waited on memory most of its time (2-3 GB/s). L2 rather than L1 (locality 1, not 3): L1 has
// too few slots for a block's lines in flight; measured here at 64 rows x 1,024 tokens, blocks
// scattered: 3.3 against 4.7 ms; prefetching two or four blocks ahead instead of one: no gain.
template <typename T>
inline void prefetch_block(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elements * int64_t(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Attends query heads q [H, D] (float32, already scaled; head i reads KV head i / G) to tokens
// [begin, end) of a context whose blocks are block_ids, into p: any shape within the limits
// above, the fallback of attend_fixed() below. A block's keys (then values) for every KV head
// are one contiguous run of memory, read front to back.
template <typename T>
void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_ids, int64_t begin, int64_t end,
            int64_t block_size, int64_t KVH, int64_t G, int64_t D, Partial p) {
  const int64_t H = KVH * G, token_stride = KVH * D, block_stride = block_size * token_stride;
  alignas(64) float row[kMaxHeadDim];
  alignas(64) float scores[kMaxHeads * kMaxBlockSize];
  for (int64_t i = 0; i < H; ++i) {
    p.max[i] = -std::numeric_limits<float>::infinity();
    p.sum[i] = 0.f;
  }
  std::fill(p.acc, p.acc + H * D, 0.f);
  for (int64_t start = begin; start < end;) {
    const int64_t first = start % block_size;
    const int64_t n = std::min(block_size - first, end - start);
    const int64_t block = block_ids[start / block_size];
    if (start + n < end) {  // the next block, read while this one is attended
      const int64_t next = block_ids[start / block_size + 1];
      prefetch_block(k_cache + next * block_stride, block_stride);
      prefetch_block(v_cache + next * block_stride, block_stride);
    }
    const T* keys = k_cache + block * block_stride + first * token_stride;
    const T* values = v_cache + block * block_stride + first * token_stride;
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < KVH; ++h) {
        widen_row(keys + t * token_stride + h * D, row, D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qi = q + (h * G + g) * D;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qi[d] * row[d];
          scores[(h * G + g) * n + t] = dot;
        }
      }
    }
    for (int64_t i = 0; i < H; ++i) {
      const float rescale = fold_block_scores(scores + i * n, n, p.max[i], p.sum[i]);
      if (rescale != 1.f) {
        float* a = p.acc + i * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] *= rescale;
      }
    }
    for (int64_t t = 0; t < n; ++t) {
      for (int64_t h = 0; h < KVH; ++h) {
        widen_row(values + t * token_stride + h * D, row, D);
        for (int64_t g = 0; g < G; ++g) {
          const float w = scores[(h * G + g) * n + t];
          float* a = p.acc + (h * G + g) * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += w * row[d];
        }
      }
    }
    start += n;
  }
}

// attend() for G query heads per KV head and D = DV * kLanes dimensions known when compiled: KV
// head by KV head, its G queries and G running sums held in registers over the partition's
// blocks (3 x 4 + 3 x 4 of 32 AVX-512 registers for the default model), each block's keys
// scored, its softmax weights updated, its values summed in.
// Takes attend()'s arguments, so either can be picked per call; G and D are the template's.
template <typename T, int G, int DV>
void attend_fixed(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_ids, int64_t begin,
                  int64_t end, int64_t block_size, int64_t KVH, int64_t, int64_t, Partial p) {
  constexpr int64_t D = DV * kLanes;
  const int64_t token_stride = KVH * D, block_stride = block_size * token_stride;
  alignas(64) float row[D];
  alignas(64) float scores[G][kMaxBlockSize];
  for (int64_t h = 0; h < KVH; ++h) {
    vfloat qv[G][DV], acc[G][DV];
    float max[G], sum[G];
    for (int g = 0; g < G; ++g) {
      for (int i = 0; i < DV; ++i) {
        qv[g][i] = load(q + (h * G + g) * D + i * kLanes);
        acc[g][i] = vfloat{};
      }
      max[g] = -std::numeric_limits<float>::infinity();
      sum[g] = 0.f;
    }
    for (int64_t start = begin; start < end;) {
      const int64_t first = start % block_size;
      const int64_t n = std::min(block_size - first, end - start);
      const int64_t block = block_ids[start / block_size];
      if (start + n < end) {  // this head's rows of the next block, read while this one is attended
        const int64_t next = block_ids[start / block_size + 1] * block_stride + h * D;
        for (int64_t t = 0; t < block_size; ++t) {
          prefetch_block(k_cache + next + t * token_stride, D);
          prefetch_block(v_cache + next + t * token_stride, D);
        }
      }
      const T* keys = k_cache + block * block_stride + first * token_stride + h * D;
      const T* values = v_cache + block * block_stride + first * token_stride + h * D;
      for (int64_t t = 0; t < n; ++t) {
        widen_row(keys + t * token_stride, row, D);
        vfloat k[DV];
        for (int i = 0; i < DV; ++i) k[i] = load(row + i * kLanes);
        for (int g = 0; g < G; ++g) {
          vfloat dot = qv[g][0] * k[0];
          for (int i = 1; i < DV; ++i) dot += qv[g][i] * k[i];
          scores[g][t] = sum_lanes(dot);
        }
      }
      for (int g = 0; g < G; ++g) {
        const float rescale = fold_block_scores(scores[g], n, max[g], sum[g]);
        if (rescale != 1.f)
          for (int i = 0; i < DV; ++i) acc[g][i] *= rescale;
      }
      for (int64_t t = 0; t < n; ++t) {
        widen_row(values + t * token_stride, row, D);
        vfloat v[DV];
        for (int i = 0; i < DV; ++i) v[i] = load(row + i * kLanes);
        for (int g = 0; g < G; ++g)
          for (int i = 0; i < DV; ++i) acc[g][i] += scores[g][t] * v[i];
      }
      start += n;
    }
    for (int g = 0; g < G; ++g) {
      p.max[h * G + g] = max[g];
      p.sum[h * G + g] = sum[g];
      for (int i = 0; i < DV; ++i) store(p.acc + (h * G + g) * D + i * kLanes, acc[g][i]);
    }
  }
}

template <typename T>
using AttendFn = void (*)(const float*, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, Partial);

// The compiled shape for G query heads per KV head and D dimensions: 1-8 heads of 64 or 128
// dimensions (Llama, Qwen, Mistral, SmolLM and most others); any other shape, attend().
template <typename T, int G>
AttendFn<T> pick_for_group(int64_t D) {
  return D == 64 ? &attend_fixed<T, G, 4> : D == 128 ? &attend_fixed<T, G, 8> : &attend<T>;
}

template <typename T>
AttendFn<T> pick(int64_t G, int64_t D) {
  switch (G) {
    case 1: return pick_for_group<T, 1>(D);
    case 2: return pick_for_group<T, 2>(D);
    case 3: return pick_for_group<T, 3>(D);
    case 4: return pick_for_group<T, 4>(D);
    case 5: return pick_for_group<T, 5>(D);
    case 6: return pick_for_group<T, 6>(D);
    case 7: return pick_for_group<T, 7>(D);
    case 8: return pick_for_group<T, 8>(D);
    default: return &attend<T>;
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& block_table,
         const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t rows = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  const int64_t G = H / KVH;
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int64_t* tables = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();

  // Work items: one per (row, partition); first_part[r] is row r's first.
  std::vector<int64_t> first_part(rows + 1, 0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t len = lens[r];
    TORCH_CHECK(len > 0, "paged_decode_attention: seq_lens must be positive, got ", len, " at row ", r);
    first_part[r + 1] = first_part[r] + (len + kPartitionTokens - 1) / kPartitionTokens;
  }
  const int64_t parts = first_part[rows];
  std::vector<int64_t> row_of(parts);
  for (int64_t r = 0; r < rows; ++r) std::fill(row_of.begin() + first_part[r], row_of.begin() + first_part[r + 1], r);
  // Every partition's state, (max [H], sum [H], acc [H, D]); merged below.
  const int64_t state = H * (D + 2);
  std::vector<float> partials(parts * state);
  const float fscale = float(scale);
  const AttendFn<T> attend_fn = pick<T>(G, D);

#pragma omp parallel for schedule(dynamic, 1) num_threads(at::get_num_threads())
  for (int64_t part = 0; part < parts; ++part) {
    const int64_t r = row_of[part], index = part - first_part[r];
    alignas(64) float qf[kMaxHeads * kMaxHeadDim];
    const T* qr = qp + r * H * D;
    for (int64_t i = 0; i < H * D; ++i) qf[i] = widen(qr[i]) * fscale;
    float* s = partials.data() + part * state;
    const int64_t begin = index * kPartitionTokens, end = std::min(lens[r], begin + kPartitionTokens);
    attend_fn(qf, kp, vp, tables + r * table_stride, begin, end, block_size, KVH, G, D, Partial{s, s + H, s + 2 * H});
  }

  // Merge each row's partitions in order, normalise, round to the output dtype.
  at::parallel_for(0, rows, 1, [&](int64_t from, int64_t to) {
    alignas(64) float acc[kMaxHeadDim];
    for (int64_t r = from; r < to; ++r) {
      for (int64_t i = 0; i < H; ++i) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t part = first_part[r]; part < first_part[r + 1]; ++part)
          m = std::max(m, partials[part * state + i]);
        float total = 0.f;
        std::fill(acc, acc + D, 0.f);
        for (int64_t part = first_part[r]; part < first_part[r + 1]; ++part) {
          const float* s = partials.data() + part * state;
          const float w = std::exp(s[i] - m);
          total += s[H + i] * w;
          const float* a = s + 2 * H + i * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) acc[d] += w * a[d];
        }
        T* o = op + (r * H + i) * D;
        const float inv = 1.f / total;
        for (int64_t d = 0; d < D; ++d) o[d] = T(acc[d] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_table, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "paged_decode_attention: q [rows, heads, dim], caches [blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(q.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: q and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous() &&
                  block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "paged_decode_attention: block_table [rows, blocks] and seq_lens [rows], int64");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && H <= kMaxHeads && D <= kMaxHeadDim &&
                  k_cache.size(1) <= kMaxBlockSize,
              "paged_decode_attention: unsupported shape");
  at::Tensor out = at::empty_like(q);
  if (q.size(0) == 0) return out;
  for_dtype(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    run<decltype(tag)>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(leanserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(leanserve, CPU, m) { m.impl("paged_decode_attention", &paged_decode_attention); }
