// The instruction-set paths of the CPU kernels, one ladder for all (selection.CPU_ISA_PATHS names them,
// MOELAUNCH_CPU_ISA forces a lower one); each kernel templates its loops on the path:
// - Amx: Avx512Bf16 plus the AMX tile unit (AMX-TILE, AMX-BF16), 16 x 16 x 32 bf16 products per
//   instruction, used by MLA decode over a bf16 cache (mla_decode_amx.h); the other kernels run their
//   Avx512Bf16 code on it. Linux hands a process the tiles' state only when asked (amx_permitted): an
//   older kernel that refuses leaves the ladder at Avx512Bf16;
// - Avx512Bf16: AVX-512 plus vdpbf16ps (AVX512-BF16), bf16 x bf16 dot products with fp32 sums, used by
//   the grouped-linear and MLA decode kernels when both operands are bf16 (bf16_dot.h); the integer
//   kernels have nothing to gain from it and run their Avx512 code;
// - Avx512: 16 fp32 lanes (AVX-512F), and for the integer-weight kernels the integer dot products of
//   AVX512-VNNI;
// - Avx2: 8 fp32 lanes (AVX2 + FMA), integer dot products through 16-bit multiply-adds (vpmaddwd);
// - Scalar: one lane, plain C++ (any CPU; the reference the vector paths are tested against).
// The float kernels below Avx512Bf16 widen bf16 to fp32 (simd.h) whatever the path.
// A path exists in a build only when the compiler targets its instructions (the build is -march=native),
// and which one runs is chosen per call (`resolve`: the best the build has, or a forced one).
#pragma once

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdint>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define MOELAUNCH_HAS_AVX2 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define MOELAUNCH_HAS_AVX512 1
#endif
#if defined(MOELAUNCH_HAS_AVX512) && defined(__AVX512BF16__)
#define MOELAUNCH_HAS_AVX512_BF16 1
#endif
#if defined(MOELAUNCH_HAS_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define MOELAUNCH_HAS_AMX 1
#endif

namespace moelaunch::isa {

enum Path : int64_t { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3, kAmx = 4 };

#ifdef MOELAUNCH_HAS_AMX
// Whether Linux lets this process use the AMX tile data (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, kernels 5.16 and later): without it the first tile instruction faults. Asked once.
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
  }();
  return permitted;
}
#endif

// The best path this build and CPU have.
inline Path best_path() {
#ifdef MOELAUNCH_HAS_AMX
  if (amx_permitted()) return kAmx;
#endif
#ifdef MOELAUNCH_HAS_AVX512_BF16
  return kAvx512Bf16;
#elif defined(MOELAUNCH_HAS_AVX512)
  return kAvx512;
#elif defined(MOELAUNCH_HAS_AVX2)
  return kAvx2;
#else
  return kScalar;
#endif
}

// The path a call asked for (-1: the best), refused when this build lacks it.
inline Path resolve(int64_t path) {
  const Path best = best_path();
  if (path < 0) return best;
  TORCH_CHECK(path <= best, "CPU kernel path ", path, " is not built for this CPU (best: ", best, ")");
  return static_cast<Path>(path);
}

// Calls whose products ran through vdpbf16ps, for tests to see that the dispatch took that path.
inline std::atomic<int64_t>& bf16_dot_calls() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

// Calls whose products ran through the AMX tiles, likewise.
inline std::atomic<int64_t>& amx_calls() {
  static std::atomic<int64_t> calls{0};
  return calls;
}

}  // namespace moelaunch::isa
