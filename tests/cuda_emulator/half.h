// The emulator's stand-in for npattn/cuda/half.cuh: float16 conversions
// through the compiler's _Float16 (round to nearest even, as PTX's cvt.rn).

inline unsigned short half_bits(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  unsigned short bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

inline float half_value(unsigned short bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}
