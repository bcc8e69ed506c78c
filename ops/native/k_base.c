/* The kernels for the baseline instruction set of the build target. */
#define NATIVE_VEC 0
#define SFX(name) name##_base
#include "kernels.inc"
