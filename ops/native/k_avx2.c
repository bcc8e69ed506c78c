/* The kernels for x86-64 with AVX2 (selected at import when the CPU has AVX2 and FMA).
 * Multiply-adds stay unfused (-ffp-contract=off): the results equal the baseline's. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <math.h> /* system headers first, outside the target region */
#include <stdint.h>
#include <string.h>
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c,bmi,bmi2,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt")
#endif
#define SFX(name) name##_avx2
#include "kernels.inc"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
typedef int megaloom_no_avx2; /* not an x86-64 build: module.c never selects this set */
#endif
