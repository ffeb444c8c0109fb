// What every AMX kernel needs (Intel AMX-BF16: Sapphire Rapids and later, on Linux): the
// permission to use the tile state, and one tile configuration. User: the small-M linear
// (cpu_amx_linear.h). Note for new users: GCC's tile intrinsics stringify their tile numbers,
// so those must be literals (a template parameter fails to assemble: "bad register name").
//
// Defines KVFORGE_AMX when the compiler targets AMX-BF16 with AVX-512 (-march=native on such
// a CPU); without it nothing below exists and callers keep their other paths. Even then a
// kernel must check granted() at run time before its first tile instruction.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__linux__)
#define KVFORGE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace kvforge_amx {

constexpr int64_t kRows = 16;   // rows of every tile the kernels use
constexpr int64_t kChunk = 32;  // bf16 elements of a 64-byte tile row (16 pairs)

// Linux hands out the AMX tile state on request only (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); a tile instruction without it kills the process. Asked once per process.
inline bool granted() {
  static const bool ok = [] {
    constexpr long kRequestPermission = 0x1023;  // ARCH_REQ_XCOMP_PERM
    constexpr long kTileData = 18;               // XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Palette 1 with all eight tiles 16 rows x 64 bytes. Tile state is per thread: every
// parallel worker loads it before its first tile instruction (and releases it when done).
inline void load_tile_config() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = 64;
    config.rows[t] = static_cast<uint8_t>(kRows);
  }
  _tile_loadconfig(&config);
}

}  // namespace kvforge_amx

#endif  // AMX
