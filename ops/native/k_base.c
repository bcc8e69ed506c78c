/* The kernels for the baseline instruction set of the build target. */
#define SFX(name) name##_base
#include "kernels.inc"
