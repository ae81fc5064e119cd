// Per-task scratch memory for the CPU kernels.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace moelaunch {

// Per-task scratch values on 64-byte boundaries: a vector load that straddles two cache lines costs two,
// which made score tiles a third slower when the queries sat 16 bytes off.
template <typename T = float>
class Scratch {
 public:
  explicit Scratch(int64_t n) : lines_((n * static_cast<int64_t>(sizeof(T)) + kLine - 1) / kLine) {}
  T* data() { return reinterpret_cast<T*>(lines_.data()); }
  void zero() { std::fill(lines_.begin(), lines_.end(), Line{}); }

 private:
  static constexpr int64_t kLine = 64;
  struct alignas(kLine) Line {
    float v[kLine / sizeof(float)];
  };
  std::vector<Line> lines_;
};

}  // namespace moelaunch
