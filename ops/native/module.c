/* megaloom.ops._native: DVM fused programs and MXFP8 quantisation on CPU, without torch.
 *
 * Python hands over data pointers, shapes and strides (tensor.data_ptr(), .shape,
 * .stride()); the tensors stay alive in the caller for the duration of the call, which
 * releases the GIL while the kernels run on the pool (pool.c).
 *
 * dvm_run(code, consts, n_regs, operands, n_in, threads, block)
 *   code: bytes of int32 sextets (op, dst, a, b, c, rnd), op an index into DVM_OPS, operands
 *   a, b, c registers, -1 (none) or -2 - k for the scalar consts[k];
 *   consts: bytes of float32 scalars;
 *   operands: (ptr, dtype, reg, shape, strides) per input then per output, dtype an index
 *   into DTYPES, reg -1 for an unused input; outputs must have the broadcast shape of the
 *   inputs (the domain). block: elements per block (a multiple of 16), 0 for automatic.
 *   Raises NotImplementedError for a layout it does not take (the caller falls back).
 *   A program that has run over threshold elements is compiled to one loop in the
 *   background and runs as such once loaded (jit.c).
 * jit_config(threshold=None, cc=None, cache_dir=None), jit_stats(), jit_wait(seconds): that
 *   compilation's settings (threshold < 0: interpret every program; cc "0": never compile),
 *   counters, and a wait for pending builds.
 * mx_quantize(x, dtype, rows, cols, sx, rd, srd, rs, srs, cd, scd, cs, scs, rceil, tiles, threads)
 *   pointers as ints (0: output not wanted), strides in elements of x / bytes of outputs;
 *   tiles: None (plain 32-row tiles) or bytes of int64 triples (first source row, valid
 *   rows, first destination row) for column-wise blocks.
 * mx_dequantize(d, sd, s, ss, rows, cols, cols_axis, y, sy, dtype, threads)
 * isa(), isas(), set_isa(name): the instruction set in use / available / to use.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "native.h"
#include "pool.h"

double dvm_erf_small[ERF_SMALL_N], dvm_erf_large[ERF_LARGE_N];
const float dvm_exp_limit = 250.0f, dvm_expf_limits[2] = {-104.0f, 89.0f}, dvm_e4m3_max = 448.0f;

#define PI_ 3.141592653589793

typedef struct {
    const char *name;
    void (*dvm_run)(const DvmJob *, int64_t, int64_t, float *);
    void (*mx_rows)(const MxJob *, int64_t, int64_t);
    void (*mx_tiles)(const MxJob *, int64_t, int64_t, float *);
    void (*mx_dequant)(const MxDequantJob *, int64_t, int64_t);
} Isa;

#define ISA_ENTRY(sfx) {#sfx, dvm_run_##sfx, mx_rows_##sfx, mx_tiles_##sfx, mx_dequant_##sfx}
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
static const Isa ISAS[] = {ISA_ENTRY(base), ISA_ENTRY(avx2), ISA_ENTRY(avx512)};
#define N_ISAS 3
#else
static const Isa ISAS[] = {ISA_ENTRY(base)};
#define N_ISAS 1
#endif
static int n_supported = 1; /* ISAS[0 .. n_supported) run on this CPU */
static const Isa *isa = &ISAS[0];

static void detect_isa(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) n_supported = 2;
    if (n_supported == 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
        && __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        n_supported = 3;
#endif
    isa = &ISAS[n_supported - 1];
}

/* -- per-thread scratch ------------------------------------------------------------------ */

static _Thread_local float *tl_buf;
static _Thread_local size_t tl_cap;

static float *scratch(size_t floats) {
    if (floats > tl_cap) {
        free(tl_buf);
        size_t bytes = (floats * sizeof(float) + 63) & ~(size_t)63;
        tl_buf = aligned_alloc(64, bytes);
        tl_cap = tl_buf ? floats : 0;
    }
    return tl_buf;
}

/* -- argument helpers -------------------------------------------------------------------- */

static int get_i64_tuple(PyObject *seq, int64_t *out, int max, const char *what) {
    PyObject *fast = PySequence_Fast(seq, what);
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n > max) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_NotImplementedError, "%s: rank %zd is above %d", what, n, max);
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (out[i] == -1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    return (int)n;
}

static int threads_for(int64_t elements, int threads) {
    int64_t t = elements / 65536; /* below this a thread hand-off costs more than it saves */
    if (t < 1) t = 1;
    if (t > threads) t = threads;
    if (t > pool_max_threads()) t = pool_max_threads();
    return (int)t;
}

/* -- DVM ---------------------------------------------------------------------------------- */

#define MAXRANK 32

typedef struct {
    const DvmJob *job;
    size_t floats;
} DvmCtx;

static void dvm_range(void *ctx, int64_t b0, int64_t b1) {
    DvmCtx *c = ctx;
    float *s = scratch(c->floats);
    if (s) isa->dvm_run(c->job, b0, b1, s);
}

static int64_t span_end(const DvmOperand *op, int nd, const int64_t *shape, int64_t esize) {
    int64_t hi = 0;
    for (int d = 0; d < nd; d++) hi += (shape[d] - 1) * op->stride[d];
    return (int64_t)(intptr_t)op->ptr + (hi + 1) * esize;
}

static PyObject *py_dvm_run(PyObject *self, PyObject *args) {
    Py_buffer code, cval;
    int n_regs, n_in, threads;
    long long block;
    PyObject *operands;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*iOiiL", &code, &cval, &n_regs, &operands, &n_in, &threads, &block))
        return NULL;
    PyObject *res = NULL, *fast = NULL;
    DvmOperand ops[DVM_MAXOPS];
    int64_t shp[DVM_MAXOPS][MAXRANK], str[DVM_MAXOPS][MAXRANK];
    int rank[DVM_MAXOPS];
    static const int64_t esize[DT_COUNT] = {4, 2, 2, 1};
    int n_code = (int)(code.len / (Py_ssize_t)sizeof(DvmInstr)), n_const = (int)(cval.len / 4);
    if (n_regs < 1 || n_regs > 256 || code.len % (Py_ssize_t)sizeof(DvmInstr) || cval.len % 4
        || (block != 0 && (block < 16 || block % 16))) {
        PyErr_SetString(PyExc_ValueError, "dvm_run: malformed program");
        goto out;
    }
    fast = PySequence_Fast(operands, "operands must be a sequence");
    if (!fast) goto out;
    int n_ops = (int)PySequence_Fast_GET_SIZE(fast);
    if (n_ops > DVM_MAXOPS || n_in < 1 || n_in >= n_ops) {
        PyErr_SetString(PyExc_NotImplementedError, "dvm_run: too many operands");
        goto out;
    }
    const DvmInstr *ins = code.buf;
    for (int k = 0; k < n_code; k++) {
        const DvmInstr *i = &ins[k];
        int ok = i->op >= 0 && i->op < OP_COUNT && i->dst >= 0 && i->dst < n_regs && i->a != -1;
        for (int j = 0; ok && j < 3; j++) { /* register, -1 (none), or constant -2 - index */
            int32_t r = j == 0 ? i->a : j == 1 ? i->b : i->c;
            ok = r < n_regs && (r >= -1 || -2 - r < n_const);
        }
        if (!ok) {
            PyErr_Format(PyExc_ValueError, "dvm_run: instruction %d is malformed", k);
            goto out;
        }
    }
    /* operands; the domain is the broadcast of the inputs' shapes */
    int dom_rank = 0;
    int64_t dom[MAXRANK];
    for (int o = 0; o < n_ops; o++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, o), *shape, *strides;
        unsigned long long ptr;
        int dt, reg;
        if (!PyArg_ParseTuple(t, "KiiOO", &ptr, &dt, &reg, &shape, &strides)) goto out;
        if (dt < 0 || dt >= DT_COUNT || reg >= n_regs || (o >= n_in && reg < 0)) {
            PyErr_Format(PyExc_ValueError, "dvm_run: operand %d is malformed", o);
            goto out;
        }
        ops[o].ptr = (char *)(uintptr_t)ptr;
        ops[o].dtype = dt;
        ops[o].reg = reg;
        rank[o] = get_i64_tuple(shape, shp[o], MAXRANK, "operand shape");
        if (rank[o] < 0 || get_i64_tuple(strides, str[o], MAXRANK, "operand strides") != rank[o]) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "dvm_run: shape and strides differ in rank");
            goto out;
        }
        if (o < n_in && rank[o] > dom_rank) {
            for (int d = 0; d < rank[o] - dom_rank; d++) dom[d] = 1; /* new leading dims */
            memmove(dom + (rank[o] - dom_rank), dom, sizeof(int64_t) * dom_rank);
            for (int d = 0; d < rank[o] - dom_rank; d++) dom[d] = 1;
            dom_rank = rank[o];
        }
        if (o < n_in)
            for (int d = 0; d < rank[o]; d++) {
                int64_t *D = &dom[dom_rank - rank[o] + d], s = shp[o][d];
                if (s != 1 && *D != 1 && s != *D) {
                    PyErr_SetString(PyExc_ValueError, "dvm_run: input shapes do not broadcast");
                    goto out;
                }
                if (s != 1) *D = s;
            }
    }
    for (int o = n_in; o < n_ops; o++) {
        int ok = rank[o] == dom_rank;
        for (int d = 0; ok && d < dom_rank; d++) ok = shp[o][d] == dom[d] && (dom[d] == 1 || str[o][d] != 0);
        if (!ok) {
            PyErr_SetString(PyExc_ValueError, "dvm_run: an output does not have the inputs' broadcast shape");
            goto out;
        }
    }
    /* aligned strides over the dims larger than 1 */
    DvmJob job;
    memset(&job, 0, sizeof job);
    int64_t n_el = 1;
    for (int d = 0; d < dom_rank; d++) n_el *= dom[d];
    if (n_el == 0) {
        res = Py_None;
        Py_INCREF(res);
        goto out;
    }
    int nd = 0;
    int64_t al[DVM_MAXOPS][MAXRANK]; /* strides aligned to the domain */
    for (int d = 0; d < dom_rank; d++) {
        if (dom[d] == 1) continue;
        for (int o = 0; o < n_ops; o++) {
            int od = d - (dom_rank - rank[o]);
            al[o][nd] = (od < 0 || shp[o][od] == 1) ? 0 : str[o][od];
        }
        dom[nd++] = dom[d];
    }
    for (int o = 0; o < n_ops; o++) memcpy(str[o], al[o], sizeof(int64_t) * (size_t)nd);
    /* collapse dims that are contiguous for every operand */
    int m = 0;
    for (int d = 0; d < nd; d++) {
        int merge = m > 0;
        for (int o = 0; merge && o < n_ops; o++) merge = str[o][m - 1] == str[o][d] * dom[d];
        if (merge) {
            dom[m - 1] *= dom[d];
            for (int o = 0; o < n_ops; o++) str[o][m - 1] = str[o][d];
        } else {
            dom[m] = dom[d];
            for (int o = 0; o < n_ops; o++) str[o][m] = str[o][d];
            m++;
        }
    }
    if (m == 0) {
        dom[0] = 1;
        for (int o = 0; o < n_ops; o++) str[o][0] = 0;
        m = 1;
    }
    if (m > DVM_MAXDIM) {
        PyErr_SetString(PyExc_NotImplementedError, "dvm_run: too many non-contiguous dims");
        goto out;
    }
    job.ndim = m;
    for (int d = 0; d < m; d++) {
        job.shape[d] = dom[d];
        for (int o = 0; o < n_ops; o++) ops[o].stride[d] = str[o][d];
    }
    /* outputs are written in place only when none overlaps an input */
    job.direct_out = 1;
    for (int o = n_in; o < n_ops && job.direct_out; o++) {
        int64_t lo = (int64_t)(intptr_t)ops[o].ptr, hi = span_end(&ops[o], m, job.shape, esize[ops[o].dtype]);
        for (int i = 0; i < n_in; i++) {
            int64_t ilo = (int64_t)(intptr_t)ops[i].ptr, ihi = span_end(&ops[i], m, job.shape, esize[ops[i].dtype]);
            if (ops[i].reg >= 0 && ilo < hi && lo < ihi) job.direct_out = 0;
        }
    }
    job.n_in = n_in;
    job.n_out = n_ops - n_in;
    job.ops = ops;
    job.n_code = n_code;
    job.code = ins;
    job.n_regs = n_regs;
    job.n_const = n_const;
    job.const_val = cval.buf;
    job.fused = jit_lookup((int)(isa - ISAS), ins, n_code, ops, n_in, n_ops, n_el);
    int64_t B = block;
    if (B == 0) { /* registers in memory within about 24 KiB of L1: all (interpreted) or the operands' */
        int64_t cap = job.fused ? 4096 : 1024;
        B = (6144 / (job.fused ? n_ops : n_regs)) & ~(int64_t)63;
        B = B < 256 ? 256 : (B > cap ? cap : B);
    }
    job.block = B;
    job.cols = job.shape[m - 1];
    job.rows = m >= 2 ? job.shape[m - 2] : 1;
    int64_t outer = 1;
    for (int d = 0; d < m - 2; d++) outer *= job.shape[d];
    if (job.cols >= B) {
        job.rows_per_block = 1;
        job.n_col_chunks = (job.cols + B - 1) / B;
        job.col_chunk = ((job.cols + job.n_col_chunks - 1) / job.n_col_chunks + 15) & ~(int64_t)15;
        job.n_col_chunks = (job.cols + job.col_chunk - 1) / job.col_chunk;
    } else {
        job.col_chunk = job.cols;
        job.n_col_chunks = 1;
        job.rows_per_block = B / job.cols;
    }
    job.n_row_groups = (job.rows + job.rows_per_block - 1) / job.rows_per_block;
    job.n_blocks = outer * job.n_row_groups * job.n_col_chunks;
    int nt = threads_for(n_el, threads);
    int64_t grain = job.n_blocks / ((int64_t)nt * 8);
    DvmCtx ctx = {&job, (size_t)n_regs * (size_t)B};
    Py_BEGIN_ALLOW_THREADS
    pool_run(job.n_blocks, grain < 1 ? 1 : grain, nt, dvm_range, &ctx);
    Py_END_ALLOW_THREADS
    res = Py_None;
    Py_INCREF(res);
out:
    Py_XDECREF(fast);
    PyBuffer_Release(&code);
    PyBuffer_Release(&cval);
    return res;
}

static PyObject *py_jit_config(PyObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"threshold", "cc", "cache_dir", NULL};
    PyObject *thr = Py_None;
    const char *compiler = NULL, *dir = NULL;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|Ozz", names, &thr, &compiler, &dir)) return NULL;
    long long t = 0;
    if (thr != Py_None && (t = PyLong_AsLongLong(thr)) == -1 && PyErr_Occurred()) return NULL;
    int64_t t64 = t;
    jit_configure(thr != Py_None ? &t64 : NULL, compiler, dir);
    char c[1024], d[1024];
    jit_settings(&t64, c, d, sizeof c);
    return Py_BuildValue("{s:L,s:s,s:s}", "threshold", (long long)t64, "cc", c, "cache_dir", d);
}

static PyObject *py_jit_stats(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    JitStats s = jit_stats();
    return Py_BuildValue("{s:L,s:L,s:L,s:L,s:L,s:d,s:s}", "programs", (long long)s.programs, "pending",
                         (long long)s.pending, "built", (long long)s.built, "loaded", (long long)s.loaded, "failed",
                         (long long)s.failed, "seconds", s.seconds, "last_error", s.last_error);
}

static PyObject *py_jit_wait(PyObject *self, PyObject *args) {
    double seconds = 60.0;
    int ok;
    (void)self;
    if (!PyArg_ParseTuple(args, "|d", &seconds)) return NULL;
    Py_BEGIN_ALLOW_THREADS
    ok = jit_wait(seconds);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(ok);
}

/* -- MXFP8 -------------------------------------------------------------------------------- */

typedef struct {
    const MxJob *job;
} MxCtx;

static void mx_rows_range(void *ctx, int64_t r0, int64_t r1) { isa->mx_rows(((MxCtx *)ctx)->job, r0, r1); }

static void mx_tiles_range(void *ctx, int64_t t0, int64_t t1) {
    float *s = scratch((size_t)MX_BLOCK * MX_TILE_COLS);
    if (s) isa->mx_tiles(((MxCtx *)ctx)->job, t0, t1, s);
}

static PyObject *py_mx_quantize(PyObject *self, PyObject *args) {
    unsigned long long x, rd, rs, cd, cs;
    int dtype, rceil, threads;
    long long rows, cols, sx, srd, srs, scd, scs;
    PyObject *tiles_obj;
    (void)self;
    if (!PyArg_ParseTuple(args, "KiLLLKLKLKLKLiOi", &x, &dtype, &rows, &cols, &sx, &rd, &srd, &rs, &srs, &cd, &scd,
                          &cs, &scs, &rceil, &tiles_obj, &threads))
        return NULL;
    if (dtype < 0 || dtype > DT_F16 || cols % MX_BLOCK || rows < 0 || (!rd && !cd) || (cd && !cs) || (rd && !rs)) {
        PyErr_SetString(PyExc_ValueError, "mx_quantize: bad arguments");
        return NULL;
    }
    MxJob job = {(const char *)(uintptr_t)x, dtype, sx, cols, (uint8_t *)(uintptr_t)rd, (uint8_t *)(uintptr_t)rs,
                 (uint8_t *)(uintptr_t)cd, (uint8_t *)(uintptr_t)cs, srd, srs, scd, scs, rceil, NULL};
    MxCtx ctx = {&job};
    int nt = threads_for(rows * cols, threads);
    if (!cd) {
        Py_BEGIN_ALLOW_THREADS
        pool_run(rows, 8, nt, mx_rows_range, &ctx);
        Py_END_ALLOW_THREADS
        Py_RETURN_NONE;
    }
    Py_buffer tb = {0};
    int64_t n_tiles, *plain = NULL;
    if (tiles_obj == Py_None) {
        if (rows % MX_BLOCK) {
            PyErr_SetString(PyExc_ValueError, "mx_quantize: rows must be a multiple of 32 for column-wise blocks");
            return NULL;
        }
        n_tiles = rows / MX_BLOCK;
        plain = malloc(sizeof(int64_t) * 3 * (size_t)(n_tiles ? n_tiles : 1));
        if (!plain) return PyErr_NoMemory();
        for (int64_t t = 0; t < n_tiles; t++) {
            plain[3 * t] = plain[3 * t + 2] = t * MX_BLOCK;
            plain[3 * t + 1] = MX_BLOCK;
        }
        job.tiles = plain;
    } else {
        if (PyObject_GetBuffer(tiles_obj, &tb, PyBUF_SIMPLE) < 0) return NULL;
        if (tb.len % 24) {
            PyBuffer_Release(&tb);
            PyErr_SetString(PyExc_ValueError, "mx_quantize: tiles must be int64 triples");
            return NULL;
        }
        n_tiles = tb.len / 24;
        job.tiles = tb.buf;
    }
    Py_BEGIN_ALLOW_THREADS
    pool_run(n_tiles, 1, nt, mx_tiles_range, &ctx);
    Py_END_ALLOW_THREADS
    free(plain);
    if (tb.obj) PyBuffer_Release(&tb);
    Py_RETURN_NONE;
}

static void mx_dequant_range(void *ctx, int64_t r0, int64_t r1) { isa->mx_dequant(ctx, r0, r1); }

static PyObject *py_mx_dequantize(PyObject *self, PyObject *args) {
    unsigned long long d, s, y;
    long long sd, ss, rows, cols, sy;
    int cols_axis, dtype, threads;
    (void)self;
    if (!PyArg_ParseTuple(args, "KLKLLLiKLii", &d, &sd, &s, &ss, &rows, &cols, &cols_axis, &y, &sy, &dtype, &threads))
        return NULL;
    if (dtype < 0 || dtype > DT_F16 || cols % MX_BLOCK || (cols_axis && rows % MX_BLOCK)) {
        PyErr_SetString(PyExc_ValueError, "mx_dequantize: bad arguments");
        return NULL;
    }
    MxDequantJob job = {(const uint8_t *)(uintptr_t)d, (const uint8_t *)(uintptr_t)s, sd, ss, cols, cols_axis,
                        (char *)(uintptr_t)y, dtype, sy};
    int nt = threads_for(rows * cols, threads);
    Py_BEGIN_ALLOW_THREADS
    pool_run(rows, 8, nt, mx_dequant_range, &job);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* -- instruction sets and module ---------------------------------------------------------- */

static PyObject *py_isa(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    return PyUnicode_FromString(isa->name);
}

static PyObject *py_isas(PyObject *self, PyObject *noargs) {
    (void)self, (void)noargs;
    PyObject *t = PyTuple_New(n_supported);
    for (int i = 0; t && i < n_supported; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(ISAS[i].name));
    return t;
}

static PyObject *py_set_isa(PyObject *self, PyObject *arg) {
    (void)self;
    const char *name = PyUnicode_AsUTF8(arg);
    if (!name) return NULL;
    for (int i = 0; i < n_supported; i++)
        if (!strcmp(ISAS[i].name, name)) {
            isa = &ISAS[i];
            Py_RETURN_NONE;
        }
    PyErr_Format(PyExc_ValueError, "instruction set %s is not available on this CPU", name);
    return NULL;
}

/* The Chebyshev interpolant of f on [lo, hi] through n <= 32 points of the first kind, as
 * power-series coefficients m[0..n) in u = (2 x - lo - hi) / (hi - lo). */
static void cheb_fit(double (*f)(double), double lo, double hi, double *m, int n) {
    double fx[32], c, t[3][32] = {{1.0}, {0.0, 1.0}}; /* T_{j-1}, T_j, T_{j+1} as power series */
    for (int k = 0; k < n; k++) fx[k] = f(0.5 * (hi + lo) + 0.5 * (hi - lo) * cos(PI_ * (k + 0.5) / n));
    for (int i = 0; i < n; i++) m[i] = 0.0;
    for (int j = 0; j < n; j++) {
        double s = 0.0;
        for (int k = 0; k < n; k++) s += fx[k] * cos(PI_ * j * (k + 0.5) / n);
        c = (j == 0 ? 1.0 : 2.0) * s / n;
        const double *tj = j == 0 ? t[0] : t[1];
        for (int i = 0; i <= j; i++) m[i] += c * tj[i];
        if (j >= 1) { /* T_{j+1} = 2 u T_j - T_{j-1} */
            for (int i = 0; i < n; i++) t[2][i] = (i ? 2.0 * t[1][i - 1] : 0.0) - t[0][i];
            memcpy(t[0], t[1], sizeof t[0]);
            memcpy(t[1], t[2], sizeof t[0]);
        }
    }
}

static double erf_over_x(double t) { return t > 0.0 ? erf(sqrt(t)) / sqrt(t) : 2.0 / sqrt(PI_); } /* t = x^2 */
static double erfc_scaled(double x) { return exp(x * x) * erfc(x); }

#define OP_NAME(name, str) str,
static const char *const OP_NAMES[] = {DVM_OP_LIST(OP_NAME)};
static const char *const DT_NAMES[] = {"float32", "bfloat16", "float16", "bool"};

static PyMethodDef methods[] = {
    {"dvm_run", py_dvm_run, METH_VARARGS, "Run a DVM register program over its domain (see the module doc)."},
    {"jit_config", (PyCFunction)(void (*)(void))py_jit_config, METH_VARARGS | METH_KEYWORDS,
     "Compiling hot programs: jit_config(threshold=None, cc=None, cache_dir=None) -> the settings."},
    {"jit_stats", py_jit_stats, METH_NOARGS, "Programs seen, compiles pending, built, loaded from disk, failed."},
    {"jit_wait", py_jit_wait, METH_VARARGS, "jit_wait(seconds=60): wait for pending compiles; True when none is left."},
    {"mx_quantize", py_mx_quantize, METH_VARARGS, "MXFP8 quantisation of a 2-D view."},
    {"mx_dequantize", py_mx_dequantize, METH_VARARGS, "MXFP8 dequantisation of a 2-D view."},
    {"isa", py_isa, METH_NOARGS, "The instruction set the kernels run with."},
    {"isas", py_isas, METH_NOARGS, "Instruction sets this CPU can run."},
    {"set_isa", py_set_isa, METH_O, "Run the kernels with another available instruction set."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_native",
                                    "DVM fused programs and MXFP8 kernels on CPU (see ops/native/module.c).", -1,
                                    methods, NULL, NULL, NULL, NULL};

static PyObject *names_tuple(const char *const *names, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) PyTuple_SET_ITEM(t, i, PyUnicode_FromString(names[i]));
    return t;
}

PyMODINIT_FUNC PyInit__native(void) {
    cheb_fit(erf_over_x, 0.0, 1.0, dvm_erf_small, ERF_SMALL_N);
    cheb_fit(erfc_scaled, 1.0, 4.0, dvm_erf_large, ERF_LARGE_N);
    detect_isa();
    PyObject *m = PyModule_Create(&moddef);
    if (!m) return NULL;
    if (PyModule_AddObject(m, "DVM_OPS", names_tuple(OP_NAMES, OP_COUNT)) < 0
        || PyModule_AddObject(m, "DTYPES", names_tuple(DT_NAMES, DT_COUNT)) < 0
        || PyModule_AddIntConstant(m, "INSTR_SIZE", (long)sizeof(DvmInstr)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
