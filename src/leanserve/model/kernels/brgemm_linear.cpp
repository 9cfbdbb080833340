// bf16 linear layers on CPUs with AVX512-BF16, over weights packed once (model/prepack.py) in the
// layout of oneDNN's brgemm micro-kernel: pairs of input features interleaved (VNNI), in blocks of 32
// output features, [N / 32][K / 2][32][2]. One layout for every row count:
//
// - one row (a batch-1 decode step) is this file's own loop: a step reads every weight once to
//   multiply it by one row, so the loop is a stream over memory. Each 64-byte line of a block is
//   16 output features x one pair of inputs, so one broadcast pair and one `vdpbf16ps` consume it,
//   no sum across lanes; two pairs at a time into separate accumulators (the dot products' latency
//   would otherwise bound the loop when the weights are in the caches), and a software prefetch
//   8 KB ahead, into L2. Why: in a step the per-layer weights (0.6-3.5 MB) come from L3 or memory,
//   and oneDNN's matmul over its own packed weights streams them at ~18 GB/s on a 2-core Xeon,
//   where this loop reads them at 26, a plain read of the same bytes at 27 (the default model's
//   121 GEMMs of a step: 14.6 -> 10.5 ms; 13.0 without the prefetch).
// - two rows and more, on a CPU with AMX, go to this file's own loop over AMX's tiles (amx_rows
//   below, the tiles' product in amx.h): 32 rows x 32 features at a time, in four accumulator
//   tiles, over chunks of 256 inputs, so a block's chunk of weights (16 KB) stays in L1 while the
//   rows pass under it. It replaced oneDNN's micro-kernel there: the default model's 120 GEMMs of
//   a step, weights from memory, 1.07-1.18x at 64-512 rows (1.42-1.51 -> 1.67-1.78 TFLOP/s at
//   192-384 rows), the same bits. The micro-kernel walks all of K for each 32 rows, and a block's
//   weights and the rows' inputs (36 KB each at 576 features) do not both stay in L1's 48 KB: the
//   same tile loop without the chunks was 1.03-1.10x; chunks of 384 inputs were slower than 256
//   (1.40-1.75 against 1.49-1.83 TFLOP/s at 192-512 rows), of 288 level. A tile
//   product alone, its operands in L1, runs at ~3.1 TFLOP/s a core here; with both operands
//   walking K (72 KB) ~1.5; the 2 x 2 tiles with their loads, all in L1, ~2.1 (the same at 2 x 1
//   or 3 x 1 tiles with spare tiles loaded ahead: each tile load costs the unit ~6-7 cycles).
//   Each task asks for the weights of the thread's next block into L2 as it goes, a few lines
//   each step of 32 inputs (the next block's lines spread over the task's steps): a step of 64
//   decode rows of 128 tokens 54.6 -> 52.6 ms, 40 decode rows beside a 340-token chunk 221 -> 211
//   (medians of 4-5 interleaved rounds). Asked in one burst before each band, or twice as fast,
//   they were level or slower (our reading: prefetches past the core's queue of misses are dropped).
// - elsewhere (AVX512-BF16 without AMX, or inputs not a multiple of 32) they go to oneDNN's
//   brgemm micro-kernel itself (at::native::cpublas::brgemm, what Inductor's GEMM templates
//   call), up to 256 rows per call, a 32-feature block at a time. (The loop taking 2-4 rows was
//   measured: level at 2, slower at 3 and 4.)
//
// float32 accumulation; a bias is added in float32 before the one rounding to bf16, as oneDNN
// does. Results agree with F.linear to within a bf16 rounding (sums in another order), and a
// row's result depends on the row count only through which of the two paths runs it.
//
// Where the weight came from a GGUF file's Q4_0 / Q4_1 or Q8_0 blocks, one row can read those
// instead (codes, scales: model/prepack.py's q4_layout and q8_layout), in the packed weight's
// order: Q4 a byte per output feature per pair of inputs (the first input's code in the low
// nibble), [N / 32][K / 2][32], with each 32-input group's scale d and minimum m (Q4_0: -8 d) as
// the file stores them, fp16, [N / 32][K / 32][2][32]; Q8_0 its int8 codes as the bf16 values lie,
// [N / 32][K / 2][32][2], with d, [N / 32][K / 32][32]. The loop computes each weight as gguf-py's
// dequantization does, d * q + m or d * q in float32 (exact but for the one rounding of the sum:
// d has 11 significant bits, q 4 or 8), rounds it to bf16 as the load did, and goes on as over the
// packed line: the same products in the same order, bit for bit, from 5 or 8.5 bits a weight
// instead of 16. The dequantization is the loop's cost (~11 vector instructions per 32 Q4 weights,
// ~9 per Q8 ones, most of them on the two 512-bit ports): the default model's 120 Q4 layers of a
// step 9.4 -> 6.1 ms on the 2-core Xeon, the bf16 loop reading those layers at ~23 GB/s and this
// one their blocks at ~11. More rows keep to the bf16 copy: dequantizing a block per call cost
// more than the micro-kernel saved (256 rows: 42 -> 59 ms).
//
// oneDNN's micro-kernel computes in AVX512-BF16 dot products where it runs here; this file's loops
// need AVX512-BF16. On the 2-core AMD EPYC without AMX the model's forward against oneDNN's
// matmul: one row 16.4 -> 11.4 ms (9.3 from the Q4 blocks), 2-8 rows 1.2-1.4x, level from 16 rows
// to a 512-token prefill (bench/results/brgemm_on_epyc.md).
//
// Built at run time by leanserve/model/kernels/__init__.py, for CPUs with AVX512-BF16 (the
// runner packs for it there, model/prepack.py's has_avx512_bf16).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"

namespace {

constexpr int64_t kBlock = 32;            // output features per block of the packed weight
constexpr int64_t kGroup = 32;            // inputs per scale of a GGUF Q4 or Q8_0 block
constexpr int64_t kTaskRows = 256;        // rows of a task (a block's rows are cut into these)
constexpr int64_t kBrgemmStep = 16;       // a micro-kernel call's rows: a multiple of this plus a remainder
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead of the one-row loop's reads
// A core's L2 on Sapphire Rapids, where the groups below were measured; Zen 4's is 1 MB, so there
// inputs of 1-2 MB stay one group (not measured there).
constexpr int64_t kL2Bytes = 2 << 20;
constexpr int64_t kGroupInputBytes = 1 << 20;  // input rows a group of tasks reads

// The order in which both paths for more than one row take their tasks, (a block, a chunk of
// kTaskRows rows): block-major (a thread's consecutive tasks reuse one block of the weight), in
// groups of row chunks: all of them where the input fits in L2 (each thread then reads half the
// weight once), else as many as fit in kGroupInputBytes, group after group, so a block's rows come
// from L2, not L3, for the price of reading the weight once a group (at 2,048 rows of 576
// features three times, of 1,536 eight). With one group there the model's 120 GEMMs of a step,
// weights from memory, ran at 1.41-1.45 TFLOP/s, in groups at 1.88-1.91 (2-core Xeon with AMX, the
// micro-kernel; at 576 rows groups were slower, 1.57 against 1.66: below L2's size they stay one).
struct TaskOrder {
  int64_t row_chunks, group_chunks, group_tasks, tasks;

  TaskOrder(int64_t M, int64_t K, int64_t blocks)
      : row_chunks((M + kTaskRows - 1) / kTaskRows),
        group_chunks(M * K * 2 <= kL2Bytes
                         ? row_chunks
                         : std::clamp<int64_t>(kGroupInputBytes / (kTaskRows * K * 2), 1, row_chunks)),
        group_tasks(blocks * group_chunks),
        tasks(blocks * row_chunks) {}

  // Task t's block and row chunk.
  std::pair<int64_t, int64_t> operator()(int64_t t) const {
    const int64_t first_chunk = t / group_tasks * group_chunks;
    const int64_t chunks = std::min(group_chunks, row_chunks - first_chunk), within = t % group_tasks;
    return {within / chunks, first_chunk + within % chunks};
  }
};

// The 32 results of a block for one row, plus the bias, rounded to bf16 and stored; the last
// block of a layer whose width is not a multiple of 32 stores only its first `width` columns.
inline void store_block(__m512 lo, __m512 hi, const float* bias, c10::BFloat16* out, int64_t width) {
  if (bias != nullptr) {
    lo = _mm512_add_ps(lo, _mm512_loadu_ps(bias));
    hi = _mm512_add_ps(hi, _mm512_loadu_ps(bias + 16));
  }
  const __m256i lo16 = (__m256i)_mm512_cvtneps_pbh(lo), hi16 = (__m256i)_mm512_cvtneps_pbh(hi);
  if (width == kBlock) {
    _mm256_storeu_si256((__m256i*)out, lo16);
    _mm256_storeu_si256((__m256i*)(out + 16), hi16);
  } else {
    _mm256_mask_storeu_epi16(out, __mmask16((1u << std::min<int64_t>(width, 16)) - 1), lo16);
    if (width > 16) _mm256_mask_storeu_epi16(out + 16, __mmask16((1u << (width - 16)) - 1), hi16);
  }
}

// Two neighbouring bf16 inputs in every 32-bit lane (read through memcpy: a bf16 row is only
// 2-byte aligned).
inline __m512bh broadcast_pair(const c10::BFloat16* x) {
  int32_t pair;
  std::memcpy(&pair, x, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// Blocks [b0, b1) of one row: y = x W^T (+ bias).
void one_row(const c10::BFloat16* x, const c10::BFloat16* weight, const float* bias, c10::BFloat16* y,
             int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t pairs = K / 2;
  for (int64_t b = b0; b < b1; ++b) {
    const char* w = reinterpret_cast<const char*>(weight + b * K * kBlock);
    __m512 lo0 = _mm512_setzero_ps(), hi0 = _mm512_setzero_ps(), lo1 = _mm512_setzero_ps(), hi1 = _mm512_setzero_ps();
    int64_t p = 0;
    for (; p + 2 <= pairs; p += 2, w += 256) {  // a line per 16 features per pair: 4 lines
      for (int line = 0; line < 4; ++line) _mm_prefetch(w + kPrefetchBytes + 64 * line, _MM_HINT_T1);
      const __m512bh x0 = broadcast_pair(x + 2 * p), x1 = broadcast_pair(x + 2 * p + 2);
      lo0 = _mm512_dpbf16_ps(lo0, x0, (__m512bh)_mm512_loadu_si512(w));
      hi0 = _mm512_dpbf16_ps(hi0, x0, (__m512bh)_mm512_loadu_si512(w + 64));
      lo1 = _mm512_dpbf16_ps(lo1, x1, (__m512bh)_mm512_loadu_si512(w + 128));
      hi1 = _mm512_dpbf16_ps(hi1, x1, (__m512bh)_mm512_loadu_si512(w + 192));
    }
    if (p < pairs) {
      const __m512bh x0 = broadcast_pair(x + 2 * p);
      lo0 = _mm512_dpbf16_ps(lo0, x0, (__m512bh)_mm512_loadu_si512(w));
      hi0 = _mm512_dpbf16_ps(hi0, x0, (__m512bh)_mm512_loadu_si512(w + 64));
    }
    store_block(_mm512_add_ps(lo0, lo1), _mm512_add_ps(hi0, hi1), bias ? bias + b * kBlock : nullptr,
                y + b * kBlock, std::min(kBlock, N - b * kBlock));
  }
}

// The 32 bf16 weights of pair `p` of a Q4 block's 16 features whose codes start at `codes`
// (one byte per feature), given the features' scales and minimums of the pair's group: lane f
// holds feature f's weights for the pair's two inputs, as brgemm_linear's packed line does.
inline __m512bh q4_line(const uint8_t* codes, __m512 d, __m512 m, __m512i interleave) {
  const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(15))), d, m);
  const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(c, 4)), d, m);
  // words 0-15: the first input's weights, 16-31: the second's; interleaved into pairs
  return (__m512bh)_mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
}

// Word 2f <- f, word 2f + 1 <- 16 + f.
inline __m512i pair_interleave() {
  alignas(64) int16_t idx[32];
  for (int f = 0; f < 16; ++f) idx[2 * f] = int16_t(f), idx[2 * f + 1] = int16_t(16 + f);
  return _mm512_load_si512(idx);
}

// A group's scales (or minimums) for features [16 h, 16 h + 16) of a block.
inline __m512 q4_params(const c10::Half* p, int h) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16 * h)));
}

// Q8_0: the 32 bf16 weights of a pair of 16 features whose int8 codes start at `codes` (two per
// feature, in the packed line's order), given their scales in pairs (d of feature f in lanes 2f
// and 2f + 1 of `d0` for features 0-7, of `d1` for 8-15): the products come out in the line's
// order, no permutation needed.
inline __m512bh q8_line(const int8_t* codes, __m512 d0, __m512 d1) {
  const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(codes)))), d0);
  const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                      reinterpret_cast<const __m128i*>(codes + 16)))), d1);
  return _mm512_cvtne2ps_pbh(w1, w0);
}

// Scales of features [8 q, 8 q + 8) of a block's group, each twice: lanes 2f and 2f + 1.
inline __m512 q8_scales(const c10::Half* d, int q) {
  const __m512 s =
      _mm512_cvtph_ps(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + 8 * q))));
  return _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), s);
}

// Blocks [b0, b1) of one row over Q8_0 codes, as one_row over the dequantized weights.
void q8_one_row(const c10::BFloat16* x, const int8_t* codes, const c10::Half* scales, const float* bias,
                c10::BFloat16* y, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t pairs = K / 2, groups = K / kGroup;
  for (int64_t b = b0; b < b1; ++b) {
    const int8_t* c = codes + b * pairs * kBlock * 2;
    const c10::Half* d = scales + b * groups * kBlock;
    __m512 lo0 = _mm512_setzero_ps(), hi0 = _mm512_setzero_ps(), lo1 = _mm512_setzero_ps(), hi1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, d += kBlock) {
      const __m512 d0 = q8_scales(d, 0), d1 = q8_scales(d, 1), d2 = q8_scales(d, 2), d3 = q8_scales(d, 3);
      for (int64_t p = g * kGroup / 2; p < (g + 1) * kGroup / 2; p += 2, c += 4 * kBlock) {
        _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes + 64, _MM_HINT_T1);
        const __m512bh x0 = broadcast_pair(x + 2 * p), x1 = broadcast_pair(x + 2 * p + 2);
        lo0 = _mm512_dpbf16_ps(lo0, x0, q8_line(c, d0, d1));
        hi0 = _mm512_dpbf16_ps(hi0, x0, q8_line(c + 32, d2, d3));
        lo1 = _mm512_dpbf16_ps(lo1, x1, q8_line(c + 64, d0, d1));
        hi1 = _mm512_dpbf16_ps(hi1, x1, q8_line(c + 96, d2, d3));
      }
    }
    store_block(_mm512_add_ps(lo0, lo1), _mm512_add_ps(hi0, hi1), bias ? bias + b * kBlock : nullptr,
                y + b * kBlock, std::min(kBlock, N - b * kBlock));
  }
}

// Blocks [b0, b1) of one row, as one_row over the dequantized weights (the same products in the
// same order).
void q4_one_row(const c10::BFloat16* x, const uint8_t* codes, const c10::Half* dm, const float* bias,
                c10::BFloat16* y, int64_t K, int64_t N, int64_t b0, int64_t b1) {
  const int64_t pairs = K / 2, groups = K / kGroup;
  const __m512i interleave = pair_interleave();
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* c = codes + b * pairs * kBlock;
    const c10::Half* params = dm + b * groups * 2 * kBlock;
    __m512 lo0 = _mm512_setzero_ps(), hi0 = _mm512_setzero_ps(), lo1 = _mm512_setzero_ps(), hi1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g, params += 2 * kBlock) {
      const __m512 dlo = q4_params(params, 0), dhi = q4_params(params, 1);
      const __m512 mlo = q4_params(params + kBlock, 0), mhi = q4_params(params + kBlock, 1);
      for (int64_t p = g * kGroup / 2; p < (g + 1) * kGroup / 2; p += 2, c += 2 * kBlock) {
        // Half the bf16 loop's distance in bytes, twice its distance in weights (not tuned: the
        // loop is bound by its arithmetic); the scales, a fifth of the bytes, are left to the
        // hardware's prefetcher.
        _mm_prefetch(reinterpret_cast<const char*>(c) + kPrefetchBytes / 2, _MM_HINT_T1);
        const __m512bh x0 = broadcast_pair(x + 2 * p), x1 = broadcast_pair(x + 2 * p + 2);
        lo0 = _mm512_dpbf16_ps(lo0, x0, q4_line(c, dlo, mlo, interleave));
        hi0 = _mm512_dpbf16_ps(hi0, x0, q4_line(c + 16, dhi, mhi, interleave));
        lo1 = _mm512_dpbf16_ps(lo1, x1, q4_line(c + kBlock, dlo, mlo, interleave));
        hi1 = _mm512_dpbf16_ps(hi1, x1, q4_line(c + kBlock + 16, dhi, mhi, interleave));
      }
    }
    store_block(_mm512_add_ps(lo0, lo1), _mm512_add_ps(hi0, hi1), bias ? bias + b * kBlock : nullptr,
                y + b * kBlock, std::min(kBlock, N - b * kBlock));
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- two rows and more on a CPU with AMX: the products in its tiles (amx.h) ----------------------

constexpr int64_t kBand = 32;         // rows of a tile product's block of results (two tiles of 16)
constexpr int64_t kTileInputs = 32;   // inputs of one tile product (16 pairs)
constexpr int64_t kInputChunk = 256;  // inputs a block's weights are walked in (16 KB of them)

// y = x W^T (+ bias) for M >= 2 rows of K (a multiple of 32) features, tasks in TaskOrder's order
// (a block and up to 256 rows, block-major, in groups that fit L2); within a task, for each
// chunk of inputs, every band of 32 rows: the block's chunk of weights is read from L1 by each
// band after the first, and the rows' chunk (16 KB a band) from L2. The last band's rows, where
// fewer than 32, are read from a copy padded with zeros (their sums are dropped).
void amx_rows(const c10::BFloat16* x, const c10::BFloat16* w, const float* bias, c10::BFloat16* y, int64_t M,
              int64_t K, int64_t N, int64_t blocks) {
  const int64_t bands = (M + kBand - 1) / kBand, tail = M % kBand;
  std::vector<c10::BFloat16> padded(tail ? kBand * K : 0);
  if (tail) std::memcpy(padded.data(), x + (M - tail) * K, tail * K * sizeof(c10::BFloat16));
  const int64_t task_bands = kTaskRows / kBand;
  const TaskOrder order(M, K, blocks);
  const auto* xs = reinterpret_cast<const uint16_t*>(x);
  const auto* pad = reinterpret_cast<const uint16_t*>(padded.data());
  at::parallel_for(0, order.tasks, 1, [&](int64_t t0, int64_t t1) {
    const leanserve::TileScope tiles;
    alignas(64) float sums[kTaskRows * kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, row_chunk] = order(t);
      const int64_t band0 = row_chunk * task_bands, band1 = std::min(bands, band0 + task_bands);
      const auto* wb = reinterpret_cast<const uint16_t*>(w + b * K * kBlock);
      // Where the thread's next task takes another block, its weights (K lines of 64 bytes) are
      // asked into L2 while this task computes, a few lines each step of its tile products:
      // otherwise the first band of each block waits on memory line by line.
      const int64_t next = t + 1 < t1 ? order(t + 1).first : b;
      const char* ahead = next != b ? reinterpret_cast<const char*>(w + next * K * kBlock) : nullptr;
      // A block is K lines (an input's 32 features, 64 bytes) and the task K / 32 steps a band:
      // 32 / bands lines a step fetch the next block by the task's end.
      const int64_t ahead_lines = (kTileInputs + (band1 - band0) - 1) / (band1 - band0);
      for (int64_t k0 = 0; k0 < K; k0 += kInputChunk) {
        const int64_t depth = std::min(kInputChunk, K - k0);
        for (int64_t band = band0; band < band1; ++band) {
          const int64_t rows = std::min(kBand, M - band * kBand);
          const uint16_t* a = rows == kBand ? xs + band * kBand * K : pad;
          // The weights' rows are pairs of inputs, kBlock pairs each: the right-hand side's layout.
          ahead = leanserve::tile_product(rows > 16 ? kBand : 16, kBlock, depth, a + k0, K, wb + k0 * kBlock,
                                          kBlock, sums + (band - band0) * kBand * kBlock, kBlock, k0 > 0, ahead,
                                          ahead_lines);
        }
      }
      const int64_t width = std::min(kBlock, N - b * kBlock), m0 = band0 * kBand;
      for (int64_t i = 0; i < std::min(M, band1 * kBand) - m0; ++i)
        store_block(_mm512_load_ps(sums + i * kBlock), _mm512_load_ps(sums + i * kBlock + 16),
                    bias ? bias + b * kBlock : nullptr, y + (m0 + i) * N + b * kBlock, width);
    }
  });
}
#endif

at::Tensor brgemm_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                      int64_t out_features, const std::optional<at::Tensor>& codes,
                      const std::optional<at::Tensor>& scales) {
  TORCH_CHECK(x.dim() >= 1, "brgemm_linear: an input of at least one dimension");
  const int64_t K = x.size(-1);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "brgemm_linear: bfloat16 input and weight");
  TORCH_CHECK(weight.dim() == 4 && weight.is_contiguous() && weight.size(1) * 2 == K && weight.size(2) == kBlock &&
                  weight.size(3) == 2,
              "brgemm_linear: weight packed as [N / 32, K / 2, 32, 2] for an input of ", K, " features, got ",
              weight.sizes());
  const int64_t blocks = weight.size(0);
  TORCH_CHECK(out_features > (blocks - 1) * kBlock && out_features <= blocks * kBlock,
              "brgemm_linear: ", out_features, " output features do not fit ", blocks, " blocks of 32");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == blocks * kBlock),
              "brgemm_linear: bias float32, padded to the blocks' ", blocks * kBlock, " features");
  TORCH_CHECK(codes.has_value() == scales.has_value(), "brgemm_linear: codes and scales go together");
  const bool q4 = codes && codes->scalar_type() == at::kByte;
  if (codes) {
    TORCH_CHECK(K % kGroup == 0 && codes->is_contiguous() && scales->is_contiguous() &&
                    scales->scalar_type() == at::kHalf,
                "brgemm_linear: codes and float16 scales, contiguous, for an input of a multiple of 32 features");
    TORCH_CHECK(q4 ? codes->sizes() == at::IntArrayRef({blocks, K / 2, kBlock}) &&
                         scales->sizes() == at::IntArrayRef({blocks, K / kGroup, 2, kBlock})
                   : codes->scalar_type() == at::kChar &&
                         codes->sizes() == at::IntArrayRef({blocks, K / 2, kBlock, 2}) &&
                         scales->sizes() == at::IntArrayRef({blocks, K / kGroup, kBlock}),
                "brgemm_linear: Q4 codes uint8 [N / 32, K / 2, 32] with scales [N / 32, K / 32, 2, 32], or Q8_0 codes "
                "int8 [N / 32, K / 2, 32, 2] with scales [N / 32, K / 32, 32]; got codes ", codes->scalar_type(), " ",
                codes->sizes(), " and scales ", scales->sizes(), " for ", K, " input features");
  }
  const at::Tensor rows = x.reshape({-1, K}).contiguous();
  const int64_t M = rows.size(0), N = out_features;
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  at::Tensor y = at::empty({M, N}, x.options());
  const auto* xp = rows.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  const float* bp = bias ? bias->data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  if (M == 0) return y.view(sizes);
  if (M == 1 && codes) {
    const auto* dp = scales->data_ptr<c10::Half>();
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
      if (q4)
        q4_one_row(xp, codes->data_ptr<uint8_t>(), dp, bp, yp, K, N, b0, b1);
      else
        q8_one_row(xp, codes->data_ptr<int8_t>(), dp, bp, yp, K, N, b0, b1);
    });
    return y.view(sizes);
  }
  if (M == 1) {
    at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) { one_row(xp, wp, bp, yp, K, N, b0, b1); });
    return y.view(sizes);
  }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (K % kTileInputs == 0 && leanserve::amx_ready()) {
    amx_rows(xp, wp, bp, yp, M, K, N, blocks);
    return y.view(sizes);
  }
#endif
  // oneDNN's ukernel (torch's CPUBlas) generates a kernel per row count on first use, per thread:
  // a chunk is cut into a multiple of 16 rows and a remainder below 16, so at most 31 row counts
  // ever occur, not one per step size.
  TORCH_CHECK(at::globalContext().userEnabledMkldnn(),
              "brgemm_linear: more than one row needs oneDNN's micro-kernel, and torch.backends.mkldnn is disabled");
  const TaskOrder order(M, K, blocks);
  at::parallel_for(0, order.tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(kTaskRows * kBlock);
    // The AMX tile state brgemm configures on this thread (on a CPU with AMX) is released however
    // the loop ends.
    struct Release {
      ~Release() { at::native::cpublas::brgemm_release(true); }
    } release;
    for (int64_t t = t0; t < t1; ++t) {
      const auto [b, row_chunk] = order(t);
      const int64_t m0 = row_chunk * kTaskRows, m = std::min(kTaskRows, M - m0);
      const int64_t whole = m / kBrgemmStep * kBrgemmStep;
      for (const auto [first, count] : {std::pair{int64_t(0), whole}, std::pair{whole, m - whole}}) {
        if (count > 0)
          at::native::cpublas::brgemm(count, kBlock, K, K, kBlock, kBlock, false, xp + (m0 + first) * K,
                                      wp + b * K * kBlock, acc.data() + first * kBlock, true);
      }
      for (int64_t i = 0; i < m; ++i)
        store_block(_mm512_loadu_ps(&acc[i * kBlock]), _mm512_loadu_ps(&acc[i * kBlock + 16]),
                    bp ? bp + b * kBlock : nullptr, yp + (m0 + i) * N + b * kBlock, std::min(kBlock, N - b * kBlock));
    }
  });
  return y.view(sizes);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(leanserve, m) {
  m.def("brgemm_linear(Tensor x, Tensor weight, Tensor? bias, int out_features, Tensor? codes=None, "
        "Tensor? scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(leanserve, CPU, m) { m.impl("brgemm_linear", brgemm_linear); }
