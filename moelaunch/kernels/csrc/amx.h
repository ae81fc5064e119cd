// The AMX tile registers, for kernels on the Amx path (cpu_isa.h).
#pragma once

#include "cpu_isa.h"

#ifdef MOELAUNCH_HAS_AMX
#include <immintrin.h>

#include <cstdint>

namespace moelaunch::amx {

// Every tile these kernels use has the largest shape: 16 rows of 64 bytes (32 bf16 or 16 fp32 values).
constexpr int kTileRows = 16;
constexpr int kTileRowBytes = 64;

// This thread's eight tile registers for one scope: their shapes loaded (ldtilecfg) on entry and the
// tiles released (tilerelease) on exit, so the OS stops saving their 8 KB at every context switch.
class Tiles {
 public:
  Tiles() {
    Config config{};
    config.palette = 1;
    for (int i = 0; i < 8; ++i) {
      config.bytes_per_row[i] = kTileRowBytes;
      config.rows[i] = kTileRows;
    }
    _tile_loadconfig(&config);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;

 private:
  // The 64-byte layout ldtilecfg reads (palette 1: eight tiles).
  struct alignas(64) Config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
  };
};

}  // namespace moelaunch::amx

#endif
