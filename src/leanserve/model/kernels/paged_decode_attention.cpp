// Decode attention over the paged KV cache, for the CPU: one query token per sequence against
// the keys and values of its own blocks, read where they lie in the cache (no gather, no
// padding to the longest context), with all query heads that share a KV head in one pass, so
// each key and value row is read from memory once and used G times. A block holds each KV
// head's keys and values together, the keys dimension-major in groups of 32 bits
// (model/kv_layout.py says what a block holds, and why).
//
// Why it exists (bench/results/model.md): SDPA's flash kernel over gathered keys tiles a decode
// row's G = 3 query heads (the default model) as 3-row tiles, ~29 GFLOP/s here, and the gather
// copies every key first. This kernel keeps a KV head's G queries in L1 and their G running sums
// in registers and streams the blocks through them: 16 keys at a time in the 16 lanes of a
// vector, each key's score a sum of multiply-adds down its own lane (the keys' layout makes 16
// keys' group of dimensions one load), so the softmax runs on whole vectors and nothing is summed
// across lanes; then each value row times its weight into the sums. All in float32 multiply-adds:
// on the Xeon these issue two a cycle where bf16 dot products (vdpbf16ps) issue one every two.
// One layer of 64 rows x 1,024 tokens of the default model in bf16, 2 threads:
// bench/results/decode_lanes.md.
//
// Numerics: the query times the softmax scale in float32, scores, softmax and the weighted sum in
// float32 (bf16 keys and values widened exactly) with an online (running max) softmax, the result
// rounded once to the cache's dtype. A row's result depends only on its own query and context:
// contexts are cut into partitions of a fixed number of tokens (kPartitionTokens, not a function
// of the batch or the threads), each attended on its own and merged in order, so the output is
// bitwise the same whatever rows share the step (batch invariance, tested).
//
// The query rows are read where the model leaves them, in the QKV projection's output (rows
// strided, each row's heads contiguous), not copied out first. write_kv, at the end, puts a step's
// new keys and values into the cache this kernel reads.
//
// Built at run time by leanserve/model/kernels/__init__.py (g++ -O3 -march=native -fopenmp,
// linked against the libgomp torch loaded, so its threads are torch's).

#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common.h"

namespace {

using leanserve::exp_nonpositive;
using leanserve::for_dtype;
using leanserve::kKeyGroup;
using leanserve::key_offset;
using leanserve::load;
using leanserve::store;
using leanserve::vmax;
using leanserve::widen;

// Tokens a work item attends: long contexts split into partitions so that few rows still keep
// every thread busy; fixed, so a row's partitions (and its result) do not depend on the batch.
constexpr int64_t kPartitionTokens = 256;
constexpr int64_t kMaxHeads = 128;  // query heads
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxBlockSize = 256;

// Float vectors of 16 lanes (common.h's vfloat16: one AVX-512 register, two AVX2 or four NEON
// ones), and 16 lanes of 32 bits.
constexpr int kLanes = 16;
using vfloat = leanserve::vfloat16;
using vint = leanserve::vint16;

// The 16 lanes of 32 bits at p.
inline vint load_bits(const void* p) {
  vint v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The first `lanes` of them and zeros after: a pass whose 16 lanes would read past its block's
// keys (blocks of other than a multiple of 16 tokens).
inline vint load_bits(const void* p, int lanes) {
  vint v{};
  std::memcpy(&v, p, lanes * sizeof(int32_t));
  return v;
}

inline float max_lanes(vfloat v) {  // halves compared: 3 shuffles and maxima, then the last two lanes
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return std::max(v[0], v[1]);
}

inline float sum_lanes(vfloat v) {  // halves added: 4 shuffles and adds, not 15 dependent adds
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// 16 lanes of 32 bits as the P = kKeyGroup<T> float vectors of the elements they hold: x[j] lane
// l is element j of lane l's group. bf16 is the upper half of a float32, and a lane's first bf16
// its lower 16 bits (little-endian, as every CPU this builds for).
template <typename T>
inline void widen_lanes(vint bits, vfloat x[kKeyGroup<T>]) {
  if constexpr (std::is_same_v<T, float>) {
    x[0] = (vfloat)bits;
  } else {
    x[0] = (vfloat)(bits << 16);
    x[1] = (vfloat)(bits & int32_t(0xffff0000u));
  }
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
// scattered: 3.3 against 4.7 ms.
template <typename T>
inline void prefetch_block(const T* p, int64_t elements) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < elements * int64_t(sizeof(T)); i += 64) __builtin_prefetch(c + i, 0, 1);
}

// Walks tokens [begin, end) of a context, whose blocks are block_ids, for KV head h: f(keys,
// values, first, n, ahead) for each block's run of n tokens from offset `first` of its block, with
// the head's key group 0 of the run's first token (a key's groups are block_size keys apart:
// kv_layout.py) and its first value row (rows D apart), and Ahead, the lines f is to prefetch as
// it goes (Ahead::row): the head's block after next, or near the end of the walk the next head's
// first blocks (the caller walks the heads in turn over the same tokens).
//
// Why after next, and as it goes rather than all at once: one layer of 64 rows x 1,024 tokens
// from memory (30 layers' caches, blocks scattered; AMD EPYC, 2 threads, three interleaved
// rounds) took 2.9-3.2 ms with the next block's 64 lines asked for in one burst before each
// block, 2.8-3.0 with them spread over the block's rows, 2.3-2.7 with the block after next spread
// so, 2.5-2.8 four blocks ahead; running on into the next head's walk, 2.47-2.61 -> 2.34-2.41
// (bench/results/kv_layout.md). With keys in lanes (bench/results/decode_lanes.md) on the Xeon
// the same: one or three blocks ahead, or into L1, slower.
template <typename T>
struct Ahead {
  const T* keys = nullptr;  // nullptr: the context ends before that block
  const T* values = nullptr;

  // A row's worth of the block's key and value lines into L2 (D elements each: the whole block
  // over its rows), while the current block's row t is attended. D known when compiled, so
  // prefetch_block's loop unrolls: with the row size a run-time value instead, one layer above
  // took 3.8-4.1 ms, the prefetches all but lost.
  template <int64_t D>
  void row(int64_t t) const {
    if (keys == nullptr) return;
    prefetch_block(keys + t * D, D);
    prefetch_block(values + t * D, D);
  }
};

template <typename T, typename F>
inline void for_each_run(const T* k_cache, const T* v_cache, const int64_t* block_ids, int64_t begin, int64_t end,
                         int64_t block_size, int64_t KVH, int64_t h, int64_t D, F&& f) {
  const int64_t head_stride = block_size * D, block_stride = KVH * head_stride;
  const int64_t first_block = begin / block_size, blocks = (end - 1) / block_size - first_block + 1;
  for (int64_t start = begin; start < end;) {
    const int64_t first = start % block_size;
    const int64_t n = std::min(block_size - first, end - start);
    // Two blocks on in the walk, or in the next head's walk over the same blocks.
    int64_t later = start / block_size - first_block + 2, later_head = h;
    if (later >= blocks) later -= blocks, ++later_head;
    Ahead<T> ahead;
    if (later_head < KVH && later < blocks) {
      const int64_t at = block_ids[first_block + later] * block_stride + later_head * head_stride;
      ahead = Ahead<T>{k_cache + at, v_cache + at};
    }
    const int64_t run = block_ids[start / block_size] * block_stride + h * head_stride;
    f(k_cache + run + first * kKeyGroup<T>, v_cache + run + first * D, first, n, ahead);
    start += n;
  }
}

// Attends a row's query heads q_row [H, D] (head i reads KV head i / G; scores times scale) to tokens
// [begin, end) of a context whose blocks are block_ids, into p: any shape within the limits
// above, the fallback of attend_lanes() below. A block's keys (then values) for every KV head
// are one contiguous run of memory, read front to back (all heads a block: not for_each_run's
// walk, which takes one head through the blocks).
template <typename T>
void attend(const T* q_row, float scale, const T* k_cache, const T* v_cache, const int64_t* block_ids, int64_t begin,
            int64_t end, int64_t block_size, int64_t KVH, int64_t G, int64_t D, Partial p) {
  const int64_t H = KVH * G, head_stride = block_size * D, block_stride = KVH * head_stride;
  alignas(64) float q[kMaxHeads * kMaxHeadDim];
  for (int64_t i = 0; i < H * D; ++i) q[i] = widen(q_row[i]) * scale;
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
    const T* keys = k_cache + block * block_stride;
    const T* values = v_cache + block * block_stride + first * D;
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t d = 0; d < D; ++d) row[d] = widen(keys[h * head_stride + key_offset<T>(first + t, d, block_size)]);
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
    for (int64_t h = 0; h < KVH; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        const T* v = values + h * head_stride + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = widen(v[d]);
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

// attend() for G query heads per KV head and D dimensions known when compiled (D a multiple of 16
// P: 64 and 128 below): KV head by KV head, its G queries (times the scale) in L1, its G running
// sums in registers over the partition's blocks. Per block, 16 keys at a time (32 where the sums
// fit the registers, so enough multiply-adds are in flight that their latency does not bound the
// loop): their scores as the lanes of G vectors, a multiply-add per element of a key's 32-bit
// groups down each lane; then the block's weights folded into the running softmax; then each
// value row, widened, times its weight into the sums, which hold a value row's elements in the
// order its 32-bit lanes widen to (element j of lane l of load c: dimension 16 P c + P l + j), put
// back in order at the end.
// Takes attend()'s arguments, so either can be picked per call; G and D are the template's.
template <typename T, int G, int D>
void attend_lanes(const T* q_row, float scale, const T* k_cache, const T* v_cache, const int64_t* block_ids,
                  int64_t begin, int64_t end, int64_t block_size, int64_t KVH, int64_t, int64_t, Partial p) {
  constexpr int P = kKeyGroup<T>;
  constexpr int C = D / (kLanes * P);  // 32-bit loads of a value row
  // Passes of 16 keys scored together, each with its own G x P sums: 2 where those fit the
  // registers (the default model's 3 heads in bf16: 12 sums in flight).
  constexpr int R = G * P <= 8 ? 2 : 1;
  static_assert(D % (kLanes * P) == 0);
  const int64_t group_stride = block_size * P;  // elements from a key's group to its next
  const vfloat minus_inf = vfloat{} - std::numeric_limits<float>::infinity();
  vint lane;
  for (int l = 0; l < kLanes; ++l) lane[l] = l;
  alignas(64) float q[G * D];
  alignas(64) float scores[G][kMaxBlockSize];
  for (int64_t h = 0; h < KVH; ++h) {
    for (int64_t i = 0; i < G * D; ++i) q[i] = widen(q_row[h * G * D + i]) * scale;
    vfloat acc[G][C][P];
    float max[G], sum[G];
#pragma GCC unroll 8
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < P; ++j) acc[g][c][j] = vfloat{};
      max[g] = -std::numeric_limits<float>::infinity();
      sum[g] = 0.f;
    }
    for_each_run(k_cache, v_cache, block_ids, begin, end, block_size, KVH, h, D,
                 [&](const T* keys, const T* values, int64_t first, int64_t n, const Ahead<T>& ahead) {
      for (int64_t t0 = 0; t0 < n; t0 += R * kLanes) {
        // R passes of 16 keys: pass i's keys m[i] (0 past the run), its lanes read (16, or m[i]
        // where 16 would read past the block's keys of the group: blocks not a multiple of 16).
        int m[R], lanes[R];
        bool whole = true;
        for (int i = 0; i < R; ++i) {
          const int64_t from = t0 + i * kLanes;
          m[i] = int(std::clamp<int64_t>(n - from, 0, kLanes));
          lanes[i] = first + from + kLanes <= block_size ? kLanes : m[i];
          whole = whole && lanes[i] == kLanes;
        }
        vfloat part[R][G][P];
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i)
          for (int g = 0; g < G; ++g)
            for (int j = 0; j < P; ++j) part[i][g][j] = vfloat{};
        const auto score = [&](int64_t e, const vint (&bits)[R]) {
#pragma GCC unroll 8
          for (int i = 0; i < R; ++i) {
            vfloat x[P];
            widen_lanes<T>(bits[i], x);
            for (int g = 0; g < G; ++g)
              for (int j = 0; j < P; ++j) part[i][g][j] += x[j] * q[g * D + e * P + j];
          }
        };
        const T* k = keys + t0 * P;
        if (whole) {
#pragma GCC unroll 2
          for (int64_t e = 0; e < D / P; ++e) {
            vint bits[R];
            for (int i = 0; i < R; ++i) bits[i] = load_bits(k + e * group_stride + i * kLanes * P);
            score(e, bits);
          }
        } else {
          for (int64_t e = 0; e < D / P; ++e) {
            vint bits[R];
            for (int i = 0; i < R; ++i) bits[i] = load_bits(k + e * group_stride + i * kLanes * P, lanes[i]);
            score(e, bits);
          }
        }
#pragma GCC unroll 8
        for (int i = 0; i < R; ++i) {
          if (m[i] == 0) break;
          const vint valid = lane < (vint{} + m[i]);
          for (int g = 0; g < G; ++g) {
            vfloat sum = part[i][g][0];
            for (int j = 1; j < P; ++j) sum += part[i][g][j];
            // Lanes past the run: keys that may hold anything, weighing nothing.
            store(scores[g] + t0 + i * kLanes, valid ? sum : minus_inf);
          }
        }
      }
      // Online softmax over the block: a new max rescales what was summed so far (by 0 the first
      // time: the max was -inf).
      const int64_t passes = (n + kLanes - 1) / kLanes;
#pragma GCC unroll 8
      for (int g = 0; g < G; ++g) {
        vfloat top = load(scores[g]);
        for (int64_t i = 1; i < passes; ++i) top = vmax(top, load(scores[g] + i * kLanes));
        const float new_max = std::max(max[g], max_lanes(top));
        const float rescale = exp_nonpositive(max[g] - new_max);
        max[g] = new_max;
        vfloat total{};
        for (int64_t i = 0; i < passes; ++i) {
          const vfloat w = exp_nonpositive(load(scores[g] + i * kLanes) - new_max);
          store(scores[g] + i * kLanes, w);
          total += w;
        }
        sum[g] = sum[g] * rescale + sum_lanes(total);
        if (rescale != 1.f)
          for (int c = 0; c < C; ++c)
            for (int j = 0; j < P; ++j) acc[g][c][j] *= rescale;
      }
      for (int64_t t = 0; t < n; ++t) {
        ahead.template row<D>(t);
        vfloat v[C][P];
        for (int c = 0; c < C; ++c) widen_lanes<T>(load_bits(values + t * D + c * kLanes * P), v[c]);
#pragma GCC unroll 8
        for (int g = 0; g < G; ++g) {
          const float w = scores[g][t];
          for (int c = 0; c < C; ++c)
            for (int j = 0; j < P; ++j) acc[g][c][j] += v[c][j] * w;
        }
      }
    });
    for (int g = 0; g < G; ++g) {
      p.max[h * G + g] = max[g];
      p.sum[h * G + g] = sum[g];
      float* a = p.acc + (h * G + g) * D;
      for (int c = 0; c < C; ++c)
        for (int j = 0; j < P; ++j)
          for (int l = 0; l < kLanes; ++l) a[(c * kLanes + l) * P + j] = acc[g][c][j][l];
    }
  }
}

template <typename T>
using AttendFn = void (*)(const T*, float, const T*, const T*, const int64_t*, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, Partial);

// The compiled shape for G query heads per KV head and D dimensions: 1-8 heads of 64 or 128
// dimensions (Llama, Qwen, Mistral, SmolLM and most others); any other shape, attend().
template <typename T, int G>
AttendFn<T> pick_for_group(int64_t D) {
  return D == 64 ? &attend_lanes<T, G, 64> : D == 128 ? &attend_lanes<T, G, 128> : &attend<T>;
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
  const int64_t KVH = k_cache.size(1), block_size = k_cache.size(2);
  const int64_t G = H / KVH;
  const int64_t table_stride = block_table.stride(0);
  const T* qp = q.data_ptr<T>();
  const int64_t q_stride = q.stride(0);  // rows may be a view of the QKV buffer
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
    float* s = partials.data() + part * state;
    const int64_t begin = index * kPartitionTokens, end = std::min(lens[r], begin + kPartitionTokens);
    attend_fn(qp + r * q_stride, fscale, kp, vp, tables + r * table_stride, begin, end, block_size, KVH, G, D,
              Partial{s, s + H, s + 2 * H});
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
              "paged_decode_attention: q [rows, heads, dim], caches [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: q's rows [heads, dim] and the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: q and the caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong &&
                  block_table.dim() == 2 && block_table.stride(1) == 1 && seq_lens.is_contiguous() &&
                  block_table.size(0) == q.size(0) && seq_lens.size(0) == q.size(0),
              "paged_decode_attention: block_table [rows, blocks] and seq_lens [rows], int64");
  const int64_t H = q.size(1), D = q.size(2), KVH = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == D && H % KVH == 0 && H <= kMaxHeads && D <= kMaxHeadDim && D % 2 == 0 &&
                  k_cache.size(2) <= kMaxBlockSize,
              "paged_decode_attention: unsupported shape");
  at::Tensor out = at::empty(q.sizes(), q.options());  // contiguous, whatever q's row stride
  if (q.size(0) == 0) return out;
  for_dtype(q.scalar_type(), "paged_decode_attention", [&](auto tag) {
    run<decltype(tag)>(q, k_cache, v_cache, block_table, seq_lens, scale, out);
  });
  return out;
}

// A step's new keys and values into their slots of a layer's caches, both in one call: token t's
// head h to block slots[t] / block_size, head h, offset slots[t] % block_size, its value row with
// one memcpy, its key in groups of 32 bits block_size groups apart (the keys' layout:
// model/kv_layout.py) (k and v may be views of the QKV buffer: rows strided). What it replaces,
// an index_put_ per cache at rows computed once a step (each element through TensorIterator's
// indexing loop), took 0.31 / 0.81 / 1.91 ms a step of the default model's 30 layers at 1 / 64 /
// 192 tokens on the 2-core Xeon, this (with token-major keys, one memcpy each) 0.15 / 0.32 /
// 0.77 ms, in half the calls.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slots) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() &&
                  k.size(1) == k_cache.size(1) && k.size(2) == k_cache.size(3),
              "write_kv: k and v [tokens, kv_heads, dim], caches [blocks, kv_heads, block_size, dim]");
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: rows of k and v, and the caches, contiguous");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
                  v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: k, v and the caches must share a dtype");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k.size(0),
              "write_kv: slots [tokens], int64");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2), block_size = k_cache.size(2);
  TORCH_CHECK(D % 2 == 0, "write_kv: an even head_dim (keys are stored in groups of 32 bits)");
  const int64_t capacity = k_cache.size(0) * block_size;
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < capacity, "write_kv: slot ", slot[t], " of token ", t,
                " outside the cache's ", capacity);
  // Byte offsets: one function for both dtypes (a key group is 4 bytes in either).
  const int64_t es = k.element_size(), row_bytes = D * es, groups = row_bytes / 4, group_stride = block_size * 4;
  const int64_t k_token = k.stride(0) * es, k_head = k.stride(1) * es;
  const int64_t v_token = v.stride(0) * es, v_head = v.stride(1) * es;
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  // A decode step's rows stay on the calling thread (waking the pool costs more than the copies).
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t block = slot[t] / block_size, offset = slot[t] % block_size;
      for (int64_t h = 0; h < KVH; ++h) {
        const int64_t run = (block * KVH + h) * block_size * row_bytes;
        const char* key = kp + t * k_token + h * k_head;
        char* key_slot = kc + run + offset * 4;
        for (int64_t e = 0; e < groups; ++e) std::memcpy(key_slot + e * group_stride, key + e * 4, 4);
        std::memcpy(vc + run + offset * row_bytes, vp + t * v_token + h * v_head, row_bytes);
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(leanserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "float scale) -> Tensor");
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(leanserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
  m.impl("write_kv", &write_kv);
}
