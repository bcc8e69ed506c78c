/* Element functions of the DVM kernels: dtype conversions, transcendentals, and every
 * register operation as an expression of its operands x and y.
 *
 * Included by kernels.inc (the interpreter's loops, once per instruction set) and by the
 * programs that megaloom.ops._native generates and compiles at run time (jit.c), so both
 * compute the very same bits. Rounding steps are those of torch's CPU kernels: every
 * float32 operation rounds once, a bfloat16 / float16 result is rounded (to nearest even)
 * from float32 after each instruction, as torch does after each op; builds pass
 * -ffp-contract=off, so no multiply-add is ever fused.
 *
 * Transcendentals are evaluated in double precision and rounded once to float32, so they
 * are within 0.51 ulp of the exact result (tanh, log, erf, pow); exp is float32 with fused
 * multiply-adds (within 1 ulp), and sigmoid follows torch's formula 1 / (1 + exp(-x)) in
 * float32 (docs/dvm.md has the measured figures).
 */
#ifndef MEGALOOM_ELEM_H
#define MEGALOOM_ELEM_H

#include <math.h>
#include <string.h>

#include "native.h"

/* -- bit casts and dtype conversions --------------------------------------------------- */

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint64_t d2u(double d) { uint64_t u; memcpy(&u, &d, 8); return u; }
static inline double u2d(uint64_t u) { double d; memcpy(&d, &u, 8); return d; }

/* float32 -> nearest bfloat16 (ties to even), kept in a float32; NaN stays a quiet NaN. */
static inline float round_bf16(float f) {
    uint32_t u = f2u(f);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    uint32_t q = (u | 0x00400000u) & 0xffff0000u;
    return u2f((u & 0x7fffffffu) > 0x7f800000u ? q : r);
}

static inline float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

/* float32 -> IEEE half bits, round to nearest even, overflow to infinity. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t u = f2u(f), sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    uint32_t nrm = (a + 0x0fffu + ((a >> 13) & 1u) - 0x38000000u) >> 13; /* rebias 127 -> 15 */
    float v = u2f(a < 0x38800000u ? a : 0u) * 16777216.0f;                 /* subnormal: units of 2^-24 */
    v = (v + 8388608.0f) - 8388608.0f;                                     /* round to an integer, ties even */
    uint32_t r = a >= 0x38800000u ? nrm : (uint32_t)(int32_t)v;
    r = a >= 0x477ff000u ? 0x7c00u : r; /* >= 65520 rounds to infinity */
    r = a > 0x7f800000u ? 0x7e00u | ((a >> 13) & 0x3ffu) : r;
    return (uint16_t)(sign | r);
}

static inline float f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16, e = ((uint32_t)h >> 10) & 0x1fu, m = (uint32_t)h & 0x3ffu;
    float sub = (float)(int32_t)m * 5.9604644775390625e-8f; /* m * 2^-24, exact */
    uint32_t mag = e == 0 ? f2u(sub) : (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112u) << 23) | (m << 13));
    return u2f(sign | mag);
}

static inline float round_f16(float f) { return f16_to_f32(f32_to_f16(f)); }

/* -- transcendentals (double precision, one final rounding) ----------------------------- */

#define SHIFT 6755399441055744.0 /* 1.5 * 2^52: adding it rounds to an integer in the low bits */
#define LN2 0.6931471805599453
#define INV_LN2 1.4426950408889634

/* e^x for x in [-250, 250] (callers clamp): x = k ln2 + r, |r| <= ln2/2, Taylor to r^8
 * (truncation below 3e-10 relative), times 2^k built in the exponent field. */
static inline double exp_core(double x) {
    double kd = x * INV_LN2 + SHIFT;
    int64_t k = (int64_t)(d2u(kd) - d2u(SHIFT));
    kd -= SHIFT;
    double r = fma(kd, -LN2, x);
    double p = fma(r, 1.0 / 40320, 1.0 / 5040);
    p = fma(p, r, 1.0 / 720);
    p = fma(p, r, 1.0 / 120);
    p = fma(p, r, 1.0 / 24);
    p = fma(p, r, 1.0 / 6);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    return p * u2d((uint64_t)(k + 1023) << 52);
}

/* e^y - 1 for y in [0, 25], relatively accurate near 0: 2^k (1 + p(r)) - 1 with p = e^r - 1. */
static inline double expm1_core(double y) {
    double kd = y * INV_LN2 + SHIFT;
    int64_t k = (int64_t)(d2u(kd) - d2u(SHIFT));
    kd -= SHIFT;
    double r = y - kd * LN2;
    double p = r * (1.0 + r * (1.0 / 2 + r * (1.0 / 6 + r * (1.0 / 24 + r * (1.0 / 120 + r * (1.0 / 720
               + r * (1.0 / 5040 + r * (1.0 / 40320 + r * (1.0 / 362880)))))))));
    double s = u2d((uint64_t)(k + 1023) << 52);
    return s * p + (s - 1.0);
}

/* log(x) for finite x > 0: x = 2^e m, m in [sqrt(1/2), sqrt(2)), log m = 2 atanh(s),
 * s = (m - 1) / (m + 1), |s| < 0.172, series to s^15. */
static inline double log_core(double x) {
    uint64_t u = d2u(x);
    int64_t e = (int64_t)(u >> 52) - 1023;
    double m = u2d((u & 0x000fffffffffffffull) | 0x3ff0000000000000ull);
    int big = m > 1.4142135623730951;
    m = big ? m * 0.5 : m;
    e += big;
    double s = (m - 1.0) / (m + 1.0), s2 = s * s;
    double lm = 2.0 * s * (1.0 + s2 * (1.0 / 3 + s2 * (1.0 / 5 + s2 * (1.0 / 7 + s2 * (1.0 / 9 + s2 * (1.0 / 11
                + s2 * (1.0 / 13 + s2 * (1.0 / 15))))))));
    return (double)e * LN2 + lm;
}

/* x clamped to [-250, 250] by min / max instructions that keep a NaN. Clamping against a
 * limit the compiler cannot see (dvm_exp_limit) keeps it from splitting the vector loop
 * into cases of clamped and unclamped lanes. */
static inline double clamp_exp_arg(double x) {
    double lim = dvm_exp_limit;
    x = lim < x ? lim : x;
    return -lim > x ? -lim : x;
}

/* e^x in float32 arithmetic with fused multiply-adds (within 1 ulp; docs/dvm.md has the
 * measured figures): x = k ln2 + r by Cody-Waite with a two-part ln2, e^r = 1 + r + r^2 q(r)
 * with q the Taylor polynomial to r^7 (truncation below 1e-8 relative), times 2^k applied
 * as two halves so that subnormal results round once. Clamped to [-104, 89], where the
 * result is already 0 or infinity. */
static inline float exp_f(float x) {
    float c = dvm_expf_limits[1] < x ? dvm_expf_limits[1] : x; /* min / max that keep a NaN */
    c = dvm_expf_limits[0] > c ? dvm_expf_limits[0] : c;
    float t = fmaf(c, 1.44269504f, 12582912.0f); /* 1.5 * 2^23: rounds x / ln2 to an integer */
    int32_t k = (int32_t)(f2u(t) - f2u(12582912.0f));
    float kf = t - 12582912.0f;
    float r = fmaf(kf, -0.693145752f, c); /* ln2 = 0.693145752 + 1.42860677e-6 */
    r = fmaf(kf, -1.42860677e-6f, r);
    float q = fmaf(r, 1.0f / 5040, 1.0f / 720);
    q = fmaf(q, r, 1.0f / 120);
    q = fmaf(q, r, 1.0f / 24);
    q = fmaf(q, r, 1.0f / 6);
    q = fmaf(q, r, 0.5f);
    float p = 1.0f + fmaf(r * r, q, r);
    int32_t k1 = k >> 1, k2 = k - k1;
    return p * u2f((uint32_t)(k1 + 127) << 23) * u2f((uint32_t)(k2 + 127) << 23);
}

static inline float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

static inline float tanh_f(float x) {
    float a = fabsf(x);
    a = 10.0f < a ? 10.0f : a; /* tanh(10) rounds to 1 in float32; a NaN stays */
    double e = expm1_core(2.0 * (double)a);
    return copysignf((float)(e / (e + 2.0)), x);
}

static inline float log_f(float x) {
    float r = (float)log_core(fabs((double)x));
    r = x < 0.0f ? NAN : r;
    r = x == 0.0f ? -INFINITY : r;
    r = x == INFINITY ? INFINITY : r;
    return x != x ? x : r;
}

/* sum_j c[j] u^j (Horner, fused multiply-adds) */
#define HORNER(c, n, u, out)                                      \
    do {                                                          \
        double p_ = (c)[(n) - 1];                                 \
        _Pragma("GCC unroll 20") for (int j_ = (n) - 2; j_ >= 0; j_--) p_ = fma(p_, (u), (c)[j_]); \
        (out) = p_;                                               \
    } while (0)

/* erf: |x| <= 1: x P(x^2); 1 < |x| < 4: 1 - e^(-x^2) R(x), R = e^(x^2) erfc(x); both
 * Chebyshev interpolants fitted at import (relative error below 4e-11), held as power
 * series in the interval variable; |x| >= 4: +-1. */
static inline float erf_f(float xf) {
    double a = fabs((double)xf), small, large, w;
    HORNER(dvm_erf_small, ERF_SMALL_N, 2.0 * a * a - 1.0, w);
    small = a * w;
    double c = 1.0 > a ? 1.0 : a; /* max / min that keep a NaN */
    c = 4.0 < c ? 4.0 : c;
    HORNER(dvm_erf_large, ERF_LARGE_N, (2.0 * c - 5.0) * (1.0 / 3.0), w);
    large = 1.0 - exp_core(-c * c) * w;
    return copysignf((float)(a <= 1.0 ? small : large), xf);
}

/* x^y with IEEE pow's special cases, as exp(y log|x|) in double. */
static inline float pow_f(float xf, float yf) {
    double x = xf, y = yf, ax = fabs(x);
    double l = ax == 0.0 ? -INFINITY : (ax == INFINITY || ax != ax ? ax : log_core(ax));
    double r = exp_core(clamp_exp_arg(y * l));
    double half = y * 0.5;
    int integral = y == rint(y), odd = integral && rint(half) != half;
    float f = (float)r;
    f = (odd && signbit(xf)) ? -f : f;
    f = (x < 0.0 && !integral && ax != INFINITY) ? NAN : f;
    f = (xf == -1.0f && isinf(yf)) ? 1.0f : f;
    return (yf == 0.0f || xf == 1.0f) ? 1.0f : f;
}

/* -- register operations ------------------------------------------------------------------ */

/* X(OP, name, expression of x): one-operand register operations. */
#define DVM_UNARY(X)                                                                       \
    X(NEG, neg, -x)                                                                        \
    X(ABS, abs, fabsf(x))                                                                  \
    X(RELU, relu, 0.0f > x ? 0.0f : x)                                                     \
    X(EXP, exp, exp_f(x))                                                                  \
    X(LOG, log, log_f(x))                                                                  \
    X(SQRT, sqrt, sqrtf(x))                                                                \
    X(RSQRT, rsqrt, 1.0f / sqrtf(x))                                                       \
    X(RECIP, recip, 1.0f / x)                                                              \
    X(TANH, tanh, tanh_f(x))                                                               \
    X(SIGMOID, sigmoid, sigmoid_f(x))                                                      \
    X(ERF, erf, erf_f(x))                                                                  \
    X(COPY, copy, x)                                                                       \
    X(NONZERO, nonzero, x != 0.0f ? 1.0f : 0.0f)                                           \
    X(SILU, silu, x * sigmoid_f(x)) /* pattern functions: the float32 chains they replace */

/* X(OP, name, expression of x and y): two-operand register operations. */
#define DVM_BINARY(X)                                                                      \
    X(ADD, add, x + y)                                                                     \
    X(SUB, sub, x - y)                                                                     \
    X(MUL, mul, x * y)                                                                     \
    X(DIV, div, x / y)                                                                     \
    X(MAX, max, (x != x || y != y) ? x + y : (x > y ? x : y)) /* torch.maximum: NaN wins */ \
    X(MIN, min, (x != x || y != y) ? x + y : (x < y ? x : y))                              \
    X(CLAMPMIN, clampmin, y > x ? y : x) /* torch.clamp_min(x, y): x when unordered */     \
    X(CLAMPMAX, clampmax, y < x ? y : x)                                                   \
    X(POW, pow, pow_f(x, y))                                                               \
    X(EQ, eq, x == y ? 1.0f : 0.0f)                                                        \
    X(NE, ne, x != y ? 1.0f : 0.0f)                                                        \
    X(LT, lt, x < y ? 1.0f : 0.0f)                                                         \
    X(LE, le, x <= y ? 1.0f : 0.0f)                                                        \
    X(GT, gt, x > y ? 1.0f : 0.0f)                                                         \
    X(GE, ge, x >= y ? 1.0f : 0.0f)                                                        \
    X(SWIGLU, swiglu, x * sigmoid_f(x) * y)

#endif
