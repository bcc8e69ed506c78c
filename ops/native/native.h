/* Shared declarations of megaloom.ops._native: the DVM block interpreter and the MXFP8 kernels.
 *
 * kernels.inc holds the kernels; it is compiled once per instruction set (k_base.c,
 * k_avx2.c, k_avx512.c), each time with its own function-name suffix, and module.c picks
 * one set at import from what the CPU supports. Nothing here needs torch: tensors arrive
 * as data pointers, shapes and strides.
 */
#ifndef MEGALOOM_NATIVE_H
#define MEGALOOM_NATIVE_H

#include <stdint.h>

#define DVM_MAXDIM 8   /* dims after collapsing contiguous ones */
#define DVM_MAXOPS 128 /* inputs + outputs of one program (MegaMHC's coefficients: 76) */
#define MX_BLOCK 32
#define MX_TILE_COLS 256 /* columns of one 32-row tile held as float32 (32 KiB) */

/* Element types of operands; registers always hold float32 (bool as 0.0 / 1.0). */
enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2, DT_BOOL = 3, DT_COUNT };

/* Register operations. The order is the table exported to Python as _native.DVM_OPS. */
#define DVM_OP_LIST(X)                                                                              \
    X(NEG, "neg") X(ABS, "abs") X(RELU, "relu") X(EXP, "exp") X(LOG, "log") X(SQRT, "sqrt")        \
    X(RSQRT, "rsqrt") X(RECIP, "reciprocal") X(TANH, "tanh") X(SIGMOID, "sigmoid") X(ERF, "erf")   \
    X(ADD, "add") X(SUB, "sub") X(MUL, "mul") X(DIV, "div") X(MAX, "maximum") X(MIN, "minimum")    \
    X(CLAMPMIN, "clamp_min") X(CLAMPMAX, "clamp_max") X(POW, "pow") X(EQ, "eq") X(NE, "ne")        \
    X(LT, "lt") X(LE, "le") X(GT, "gt") X(GE, "ge") X(WHERE, "where") X(COPY, "copy")              \
    X(NONZERO, "nonzero") X(SILU, "silu") X(SWIGLU, "swiglu")
#define DVM_ENUM(name, str) OP_##name,
enum { DVM_OP_LIST(DVM_ENUM) OP_COUNT };
#undef DVM_ENUM

/* Rounding applied to an instruction's result: the value's dtype when it is not float32. */
enum { RND_NONE = 0, RND_BF16 = 1, RND_F16 = 2 };

/* dst = op(a, b, c): registers; -1 for no operand; -2 - k for the scalar const_val[k]. */
typedef struct { int32_t op, dst, a, b, c, rnd; } DvmInstr;

/* A program compiled at run time: the whole instruction list per element over registers
 * R (input registers read, output registers written), scalars C, n elements. */
typedef void (*DvmFused)(float *const *R, const float *C, int64_t n);

typedef struct {
    char *ptr;
    int32_t dtype, reg;
    int64_t stride[DVM_MAXDIM]; /* elements, per collapsed domain dim; 0 where broadcast */
} DvmOperand;

typedef struct {
    int ndim;
    int64_t shape[DVM_MAXDIM];
    int n_in, n_out;
    DvmOperand *ops; /* inputs, then outputs */
    int n_code;
    const DvmInstr *code;
    int n_regs, n_const;
    const float *const_val; /* scalar operands: an operand -2 - k is const_val[k] */
    int direct_out;     /* float32 outputs may be written in place (no output overlaps an input) */
    int64_t block;      /* elements per block (a multiple of 16) */
    int64_t rows, cols; /* the last two domain dims (rows = 1 for a 1-D domain) */
    int64_t rows_per_block, n_row_groups, col_chunk, n_col_chunks, n_blocks;
    DvmFused fused;     /* the program compiled to one loop (jit.c), or NULL: interpret */
} DvmJob;

/* MXFP8 quantisation of a 2-D view: rows blocked along columns (32 per scale), columns
 * blocked along 32-row tiles. tiles[3 t + (0, 1, 2)] = first source row, valid rows (the
 * rest of the tile reads as zeros), first destination row. */
typedef struct {
    const char *x;
    int dtype;
    int64_t sx, cols; /* row stride of x (elements); the row length */
    uint8_t *rd, *rs, *cd, *cs; /* rows data/scales, cols data/scales (NULL: not wanted) */
    int64_t srd, srs, scd, scs; /* their row strides (bytes) */
    int rceil;
    const int64_t *tiles;
} MxJob;

/* MXFP8 dequantisation: data (rows, cols) E4M3 codes, E8M0 scale codes per block. */
typedef struct {
    const uint8_t *d, *s;
    int64_t sd, ss, cols;
    int cols_axis; /* 0: a scale per 32 columns of a row; 1: per 32 rows of a column */
    char *y;
    int dtype;
    int64_t sy;
} MxDequantJob;

/* Chebyshev coefficients of the erf pieces, computed at import (module.c). */
#define ERF_SMALL_N 8
#define ERF_LARGE_N 17
extern double dvm_erf_small[ERF_SMALL_N], dvm_erf_large[ERF_LARGE_N];
/* Argument clamps, defined in module.c so that the compiler does not fold them into the
 * vector loops (it then splits them by cases): [-250, 250] for the double-precision exp,
 * [-104, 89] for the float32 one. */
extern const float dvm_exp_limit, dvm_expf_limits[2], dvm_e4m3_max; /* and 448, E4M3's largest value */

/* Run-time compilation of hot programs (jit.c). */
typedef struct {
    int64_t programs, pending, built, loaded, failed;
    double seconds; /* building (compiler runs), in total */
    char last_error[512];
} JitStats;
DvmFused jit_lookup(int isa_index, const DvmInstr *code, int n_code, const DvmOperand *ops, int n_in, int n_ops,
                    int64_t elements);
void jit_configure(const int64_t *threshold, const char *compiler, const char *cache_dir);
void jit_settings(int64_t *threshold, char *compiler, char *cache_dir, size_t cap);
JitStats jit_stats(void);
int jit_wait(double seconds);

#define NATIVE_DECLARE(sfx)                                                                   \
    void dvm_run_##sfx(const DvmJob *job, int64_t b0, int64_t b1, float *scratch);            \
    void mx_rows_##sfx(const MxJob *j, int64_t r0, int64_t r1);                                \
    void mx_tiles_##sfx(const MxJob *j, int64_t t0, int64_t t1, float *tile);                  \
    void mx_dequant_##sfx(const MxDequantJob *j, int64_t r0, int64_t r1);
NATIVE_DECLARE(base)
NATIVE_DECLARE(avx2)
NATIVE_DECLARE(avx512)

#endif
