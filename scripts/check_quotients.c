/* The half route's quotient (fp8ray/codec/kernels/halfcast.py) is RN(a / b) in fp32:
 *     y = RN(1 / b),  q0 = RN(a * y),  r = fma(-b, q0, a),  q = fma(r, y, q0).
 * q0 can be up to 1.25 ulp off and r then rounded (0.6% of pairs), so Markstein's theorem
 * does not cover it; the result can only go wrong next to a rounding midpoint. This
 * checks, for every divisor significand b in [1, 2), every dividend significand a whose
 * quotient lies within K * 2**-24 ulp of a midpoint of fp32's grid (in both binades a / b
 * can fall in), against IEEE division. Exponents only scale both sides while nothing
 * underflows or overflows, which halfcast.SCALE_RANGE and the clamp see to.
 *
 *     cc -O2 -mfma -ffp-contract=off -o /tmp/check_quotients scripts/check_quotients.c -lm
 *     /tmp/check_quotients 512     # 3e9 pairs, 30 s; prints "tested N ... wrong 0"
 *
 * (Written by a review of the change that brought the route in, 2026-12-05.)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

static float from_bits(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

/* The inverse of odd b modulo 2**64 (Newton's iteration on the integers). */
static uint64_t odd_inverse(uint64_t b) { uint64_t x = b; for (int i = 0; i < 6; i++) x *= 2 - b * x; return x; }

int main(int argc, char **argv) {
  long K = argc > 1 ? atol(argv[1]) : 512;
  long tested = 0, wrong = 0, inexact_remainders = 0;
  for (uint64_t B = 1u << 23; B < (1u << 24); B++) {
    float b = from_bits((uint32_t)(0x3F800000u | (B & 0x7FFFFF)));
    volatile float reciprocal = 1.0f / b;
    float y = reciprocal;
    int k = __builtin_ctzll(B);
    uint64_t odd_b = B >> k;
    /* A midpoint is M / 2**T with M odd in (2**24, 2**25): T = 24 for quotients in [1, 2), 25 in [1/2, 1).
       A / B lies D / (B * 2**T) from it when B * M + D = A * 2**T: solve for M modulo 2**(T - k). */
    for (int T = 24; T <= 25; T++) {
      if (k >= T) continue;
      int bits = T - k;
      uint64_t mask = (1ull << bits) - 1, inverse = odd_inverse(odd_b) & mask;
      for (long Dp = -(K >> k) | 1; Dp <= (K >> k); Dp += 2) {
        int64_t D = Dp * (1ll << k);
        for (uint64_t M = ((uint64_t)(-(int64_t)Dp) * inverse) & mask; M < (1ull << 25); M += 1ull << bits) {
          if (M <= (1ull << 24) || !(M & 1)) continue;
          __int128 numerator = (__int128)B * M + D;
          if (numerator < 0 || (numerator & ((1ull << T) - 1))) continue;
          uint64_t A = (uint64_t)(numerator >> T);
          if (A < (1u << 23) || A >= (1u << 24)) continue;
          float a = from_bits((uint32_t)(0x3F800000u | (A & 0x7FFFFF)));
          float q0 = a * y, r = fmaf(-b, q0, a), q = fmaf(r, y, q0);
          tested++;
          inexact_remainders += (double)r != (double)a - (double)b * (double)q0;
          if (q != a / b && wrong++ < 20) printf("wrong: a=%a b=%a q=%a a/b=%a\n", a, b, q, a / b);
        }
      }
    }
  }
  printf("tested %ld pairs within %ld * 2**-24 ulp of a midpoint: %ld inexact remainders, wrong %ld\n", tested, K, inexact_remainders, wrong);
  return wrong != 0;
}
