// AMX's tile unit: whether the CPU has it (both kernels that use it ask here), whether the process
// may use the tiles, their one configuration, and a product of a matrix by one laid out as a tile
// product's right-hand side (for the linear layers, brgemm_linear.cpp).
//
// Why leanserve's own loop rather than oneDNN's brgemm micro-kernel (at::native::cpublas::brgemm,
// which brgemm_linear.cpp called before): it walks all of a product's depth for each 32 rows,
// where a loop of our own walks it in chunks that keep its right-hand side in L1 (1.07-1.18x a
// linear layer's, brgemm_linear.cpp says where measured). (The prefill attention's products, taken here
// instead of the micro-kernel's, were measured level: 26-34 -> 26-27 ms a 320-token chunk's 30
// layers at 704 tokens of context; they stay oneDNN's.)
#pragma once

#include <ATen/cpu/Utils.h>

namespace leanserve {

// Whether the CPU has AMX's tile unit and its bf16 products (asked of cpuinfo once). Outside the
// guard below: the prefill attention asks it too, for oneDNN's micro-kernel, which takes the tiles'
// permission itself.
inline bool cpu_has_amx() {
  static const bool amx = [] {
    const auto caps = at::cpu::get_cpu_capabilities();
    const auto tile = caps.find("amx_tile"), bf16 = caps.find("amx_bf16");
    return tile != caps.end() && bf16 != caps.end() && tile->second.toBool() && bf16->second.toBool();
  }();
  return amx;
}

}  // namespace leanserve

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace leanserve {

// Whether the CPU has the tiles and Linux hands this process their 8 KB of state (arch_prctl
// ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA: asked once; oneDNN asks the same where it uses them first).
inline bool amx_ready() {
  static const bool ready = cpu_has_amx() && syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ready;
}

// The tiles as tile_product uses them, on the calling thread, until the object goes: tiles 0-3
// the sums (2 i + j: rows 16 i .. 16 i + 15 of a 32 x 32 block of the result, columns 16 j ..
// 16 j + 15), 4-5 two row tiles of the left-hand side, 6-7 two column tiles of the right; every
// tile 16 rows of 64 bytes. Released through oneDNN's call, which also forgets the configuration
// its micro-kernel last set on this thread (this one replaced it).
class TileScope {
 public:
  TileScope() { _tile_loadconfig(&config_); }
  ~TileScope() { at::native::cpublas::brgemm_release(true); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;

 private:
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config_;
};

// One block of up to 32 x 32 results: kRows, kCols 1 or 2 tiles of 16.
template <bool kTwoRows, bool kTwoCols>
inline void tile_block(int64_t depth, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t ldb, float* c,
                       int64_t ldc, bool accumulate, const char* ahead, int64_t ahead_lines) {
  const int64_t c_bytes = ldc * 4, a_bytes = lda * 2, b_bytes = ldb * 4;
  if (accumulate) {
    _tile_loadd(0, c, c_bytes);
    if (kTwoCols) _tile_loadd(1, c + 16, c_bytes);
    if (kTwoRows) _tile_loadd(2, c + 16 * ldc, c_bytes);
    if (kTwoRows && kTwoCols) _tile_loadd(3, c + 16 * ldc + 16, c_bytes);
  } else {
    _tile_zero(0);
    if (kTwoCols) _tile_zero(1);
    if (kTwoRows) _tile_zero(2);
    if (kTwoRows && kTwoCols) _tile_zero(3);
  }
  for (int64_t k = 0; k < depth; k += 32) {
    const uint16_t* bk = b + k * ldb;  // pair row k / 2: ldb pairs of 2
    for (int64_t line = 0; line < ahead_lines; ++line, ahead += 64) _mm_prefetch(ahead, _MM_HINT_T1);
    // Every load of the step before its products (measured: the second column tile loaded
    // between the first two products cost ~5 % of a linear layer's time).
    _tile_loadd(4, a + k, a_bytes);
    _tile_loadd(6, bk, b_bytes);
    if (kTwoCols) _tile_loadd(7, bk + 32, b_bytes);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwoCols) _tile_dpbf16ps(1, 4, 7);
    if (kTwoRows) {
      _tile_loadd(5, a + 16 * lda + k, a_bytes);
      _tile_dpbf16ps(2, 5, 6);
      if (kTwoCols) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, c_bytes);
  if (kTwoCols) _tile_stored(1, c + 16, c_bytes);
  if (kTwoRows) _tile_stored(2, c + 16 * ldc, c_bytes);
  if (kTwoRows && kTwoCols) _tile_stored(3, c + 16 * ldc + 16, c_bytes);
}

// c [rows][cols] (ldc floats apart) = a b, or += where `accumulate`: a [rows][depth] bf16 (lda
// apart), b [depth / 2][ldb][2] bf16, pairs of depth (the layout of a tile product's right-hand
// side; columns [0, cols) of its ldb). rows and cols multiples of 16, depth of 32; a TileScope
// on the calling thread. Each result is its row's and column's products in depth order, 32 at a
// time, whatever the other rows and columns: the same bits as oneDNN's micro-kernel. With `ahead`,
// each step of 32 in depth also asks for `ahead_lines` lines of 64 bytes from there on into L2
// (what the caller reads next: spread so, the requests fit the core's queue of misses); returns
// where those requests stopped, the caller's next `ahead` (nullptr stays nullptr).
inline const char* tile_product(int64_t rows, int64_t cols, int64_t depth, const uint16_t* a, int64_t lda,
                                const uint16_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
                                const char* ahead = nullptr, int64_t ahead_lines = 0) {
  for (int64_t r = 0; r < rows; r += 32) {
    for (int64_t col = 0; col < cols; col += 32) {
      const uint16_t *ar = a + r * lda, *bc = b + col * 2;
      float* cb = c + r * ldc + col;
      const bool two_rows = r + 16 < rows, two_cols = col + 16 < cols;
      const int64_t lines = ahead ? ahead_lines : 0;
      if (two_rows && two_cols)
        tile_block<true, true>(depth, ar, lda, bc, ldb, cb, ldc, accumulate, ahead, lines);
      else if (two_rows)
        tile_block<true, false>(depth, ar, lda, bc, ldb, cb, ldc, accumulate, ahead, lines);
      else if (two_cols)
        tile_block<false, true>(depth, ar, lda, bc, ldb, cb, ldc, accumulate, ahead, lines);
      else
        tile_block<false, false>(depth, ar, lda, bc, ldb, cb, ldc, accumulate, ahead, lines);
      ahead += depth / 32 * lines * 64;  // unchanged where there is none (lines 0)
    }
  }
  return ahead;
}

}  // namespace leanserve

#endif
