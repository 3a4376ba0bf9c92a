// Bit writers shared by the sparse codec's CPU kernels (csrc/sparse_cpu.cpp, csrc/rice_cpu.cpp): LSB-first bits
// into zeroed, byte-aligned rows, and the Rice code of one gap (the format: dilocox/compress/rice.py).
#pragma once

#include <cstdint>

namespace dilocox {

// v (< 2^57) OR-ed into row from bit ``pos`` on, LSB-first, a byte at a time (never past the value's last byte:
// the next row may belong to another thread)
inline void or_bits(uint8_t* row, int64_t pos, uint64_t v) {
  uint64_t w = v << (pos & 7);
  for (uint8_t* b = row + (pos >> 3); w != 0; ++b, w >>= 8) *b |= static_cast<uint8_t>(w & 0xffu);
}

// the Rice code of gap d with parameter b (<= 31) at bit ``pos`` of row (zeroed): d >> b one-bits, a zero, the b
// low bits of d most significant first (compress/rice.py); returns the bit after it. Runs of bits at a time.
inline int64_t put_rice(uint8_t* row, int64_t pos, int64_t d, int b) {
  for (int64_t q = d >> b; q > 0;) {
    const int64_t n = q < 48 ? q : 48;
    or_bits(row, pos, (uint64_t{1} << n) - 1u);
    pos += n, q -= n;
  }
  ++pos;  // the zero
  uint64_t low = 0;  // the b low bits, reversed: the most significant goes first (lowest position)
  for (int t = 0; t < b; ++t) low |= static_cast<uint64_t>((d >> (b - 1 - t)) & 1) << t;
  or_bits(row, pos, low);
  return pos + b;
}

}  // namespace dilocox
