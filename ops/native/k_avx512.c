/* The kernels for x86-64 with AVX-512 (F, BW, DQ, VL), 512-bit vectors. */
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <math.h> /* system headers first, outside the target region */
#include <stdint.h>
#include <string.h>
#ifdef __clang__
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,popcnt"))), apply_to = function)
#else
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c,bmi,bmi2,popcnt,prefer-vector-width=512")
#endif
#define SFX(name) name##_avx512
#include "kernels.inc"
#ifdef __clang__
#pragma clang attribute pop
#endif
#else
typedef int megaloom_no_avx512; /* not an x86-64 build: module.c never selects this set */
#endif
