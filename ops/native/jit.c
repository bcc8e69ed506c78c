/* Hot DVM programs compiled at run time into one loop over the data.
 *
 * The interpreter (kernels.inc) runs every instruction as a pass over a block in L1: a
 * load and a store per instruction per vector. Once a program (its register code, the
 * registers of its operands and the instruction set) has processed `threshold` elements
 * in total, a background thread writes it out as C, one loop whose values stay in
 * registers, compiles it with the system's C compiler into a shared library and loads it;
 * later calls run that loop (dvm_run in kernels.inc calls it per block in place of the
 * interpreter). The loop is made of the very expressions of elem.h, compiled with the same
 * floating-point flags, so it computes the interpreter's bits (NaN signs aside, which follow
 * operand order). Until it is loaded, for good when no compiler is found or the build
 * fails, and while the threshold is set below 0, the interpreter runs: compiling a program
 * (lowering in Python) stays a matter of microseconds.
 *
 * Libraries are cached on disk under a hash of their source, the compiler command and the
 * headers (`<cache>/dvm-<hash>.so`, written under a temporary name and renamed), so
 * another process loads them at once. The cache is $MEGALOOM_CACHE_DIR/dvm, else
 * $XDG_CACHE_HOME/megaloom/dvm, else ~/.cache/megaloom/dvm; the compiler is
 * $MEGALOOM_DVM_CC, else `cc` ("0" turns compiling off).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "elem.h"

extern char **environ;

enum { COLD, QUEUED, READY, FAILED };

typedef struct Entry {
    uint64_t hash;
    int32_t *sig; /* isa, n_in, n_ops, operand registers, then the code's int32 fields */
    int n_sig;
    _Atomic int state;
    int64_t elements;
    DvmFused fn;
    struct Entry *next, *queued;
} Entry;

#define BUCKETS 1024
#define MAX_ENTRIES 4096
#define CMD_MAX 1024
static Entry *table[BUCKETS];
static int n_entries;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t work = PTHREAD_COND_INITIALIZER, idle = PTHREAD_COND_INITIALIZER;
static Entry *queue_head, *queue_tail;
static int pending, worker_started, atfork_set;
static _Atomic int64_t threshold = (int64_t)1 << 22; /* < 0: interpret every program */
static char cc[CMD_MAX], cache[CMD_MAX], native_dir[CMD_MAX], last_error[512];
static int configured;
static int64_t n_built, n_loaded, n_failed;
static double build_seconds;

/* Per instruction set (module.c's ISAS order), the target options of k_base.c, k_avx2.c, k_avx512.c. */
static const char *const ISA_FLAGS[] = {
    "",
    "-mavx2 -mfma -mf16c -mbmi -mbmi2 -mpopcnt",
    "-mavx512f -mavx512bw -mavx512dq -mavx512vl -mavx2 -mfma -mf16c -mbmi -mbmi2 -mpopcnt -mprefer-vector-width=512",
};
#define FLAGS "-O3 -std=c11 -ffp-contract=off -fno-math-errno -fno-trapping-math -fPIC -shared"

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
    return h;
}
#define FNV0 14695981039346656037ull

/* -- configuration ----------------------------------------------------------------------- */

static void set_default_cache(void) {
    const char *m = getenv("MEGALOOM_CACHE_DIR"), *x = getenv("XDG_CACHE_HOME"), *h = getenv("HOME");
    if (m && *m) snprintf(cache, sizeof cache, "%s/dvm", m);
    else if (x && *x) snprintf(cache, sizeof cache, "%s/megaloom/dvm", x);
    else if (h && *h) snprintf(cache, sizeof cache, "%s/.cache/megaloom/dvm", h);
    else snprintf(cache, sizeof cache, "/tmp/megaloom-%d/dvm", (int)getuid());
}

static void configure(void) { /* under mu */
    if (configured) return;
    configured = 1;
    const char *c = getenv("MEGALOOM_DVM_CC");
    snprintf(cc, sizeof cc, "%s", c ? c : "cc");
    set_default_cache();
    Dl_info info;
    if (dladdr((void *)jit_lookup, &info) && info.dli_fname) {
        snprintf(native_dir, sizeof native_dir, "%s", info.dli_fname);
        char *slash = strrchr(native_dir, '/');
        if (slash) snprintf(slash + 1, sizeof native_dir - (size_t)(slash + 1 - native_dir), "native");
        else snprintf(native_dir, sizeof native_dir, "native");
    }
}

static int enabled(void) { return threshold >= 0 && cc[0] && strcmp(cc, "0") != 0; }

void jit_configure(const int64_t *thr, const char *compiler, const char *cache_dir) {
    pthread_mutex_lock(&mu);
    configure();
    if (thr) threshold = *thr;
    if (compiler) snprintf(cc, sizeof cc, "%s", compiler);
    if (cache_dir) {
        if (*cache_dir) snprintf(cache, sizeof cache, "%s", cache_dir);
        else set_default_cache();
    }
    pthread_mutex_unlock(&mu);
}

void jit_settings(int64_t *thr, char *compiler, char *cache_dir, size_t cap) {
    pthread_mutex_lock(&mu);
    configure();
    *thr = threshold;
    snprintf(compiler, cap, "%s", cc);
    snprintf(cache_dir, cap, "%s", cache);
    pthread_mutex_unlock(&mu);
}

JitStats jit_stats(void) {
    pthread_mutex_lock(&mu);
    JitStats s = {n_entries, pending, n_built, n_loaded, n_failed, build_seconds, {0}};
    snprintf(s.last_error, sizeof s.last_error, "%s", last_error);
    pthread_mutex_unlock(&mu);
    return s;
}

/* -- source of one program ------------------------------------------------------------------ */

typedef struct {
    char *p;
    size_t n, cap;
} Buf;

static void put(Buf *b, const char *fmt, ...) {
    va_list ap;
    for (;;) {
        va_start(ap, fmt);
        int k = vsnprintf(b->p ? b->p + b->n : NULL, b->p ? b->cap - b->n : 0, fmt, ap);
        va_end(ap);
        if (k < 0) return;
        if (b->p && b->n + (size_t)k < b->cap) {
            b->n += (size_t)k;
            return;
        }
        size_t cap = (b->cap + (size_t)k + 1) * 2;
        char *q = realloc(b->p, cap);
        if (!q) return;
        b->p = q, b->cap = cap;
    }
}

#define EXPR_STR(OP, NAME, EXPR) [OP_##OP] = #EXPR,
static const char *const EXPRS[OP_COUNT] = {DVM_UNARY(EXPR_STR) DVM_BINARY(EXPR_STR)};

static void operand(Buf *b, const char *name, int32_t r) {
    if (r >= 0) put(b, "%s = r%d", name, r);
    else if (r <= -2) put(b, "%s = c%d", name, -2 - r);
    else put(b, "%s = 0.0f", name);
}

/* The C source of a program: per element, load the input registers, run the instructions
 * on registers held in local variables, store the output registers. */
static char *program_source(const Entry *e) {
    const int32_t *s = e->sig;
    int n_in = s[1], n_ops = s[2];
    const int32_t *regs = s + 3;
    const DvmInstr *code = (const DvmInstr *)(s + 3 + n_ops);
    int n_code = (int)((e->n_sig - 3 - n_ops) * sizeof(int32_t) / sizeof(DvmInstr));
    int n_regs = 0, n_const = 0;
    for (int o = 0; o < n_ops; o++) n_regs = regs[o] + 1 > n_regs ? regs[o] + 1 : n_regs;
    for (int k = 0; k < n_code; k++) {
        const int32_t f[4] = {code[k].dst, code[k].a, code[k].b, code[k].c};
        for (int j = 0; j < 4; j++) {
            n_regs = f[j] + 1 > n_regs ? f[j] + 1 : n_regs;
            n_const = -1 - f[j] > n_const ? -1 - f[j] : n_const;
        }
    }
    Buf b = {0};
    put(&b, "#include \"elem.h\"\n"
            "__attribute__((weak)) const float dvm_exp_limit = 250.0f, dvm_expf_limits[2] = {-104.0f, 89.0f},"
            " dvm_e4m3_max = 448.0f;\n"
            "double dvm_erf_small[ERF_SMALL_N], dvm_erf_large[ERF_LARGE_N];\n"
            "void dvm_fused(float *const *R, const float *C, int64_t n) {\n");
    for (int o = 0; o < n_ops; o++)
        if (regs[o] >= 0)
            put(&b, "    %sfloat *restrict %c%d = R[%d];\n", o < n_in ? "const " : "", o < n_in ? 'i' : 'o', regs[o],
                regs[o]);
    for (int k = 0; k < n_const; k++) put(&b, "    const float c%d = C[%d];\n", k, k);
    put(&b, "    for (int64_t i = 0; i < n; i++) {\n");
    for (int r = 0; r < n_regs; r++) put(&b, "        float r%d = 0.0f;\n", r);
    for (int o = 0; o < n_in; o++)
        if (regs[o] >= 0) put(&b, "        r%d = i%d[i];\n", regs[o], regs[o]);
    for (int k = 0; k < n_code; k++) {
        const DvmInstr *in = &code[k];
        put(&b, "        { const float ");
        operand(&b, "x", in->op == OP_WHERE ? in->b : in->a);
        put(&b, ", ");
        operand(&b, "y", in->op == OP_WHERE ? in->c : in->b);
        if (in->op == OP_WHERE) {
            put(&b, ", ");
            operand(&b, "w", in->a);
            put(&b, "; r%d = w != 0.0f ? x : y; }\n", in->dst);
        } else {
            put(&b, "; r%d = (%s); (void)y; }\n", in->dst, EXPRS[in->op]);
        }
        if (in->rnd == RND_BF16) put(&b, "        r%d = round_bf16(r%d);\n", in->dst, in->dst);
        else if (in->rnd == RND_F16) put(&b, "        r%d = round_f16(r%d);\n", in->dst, in->dst);
    }
    for (int o = n_in; o < n_ops; o++) put(&b, "        o%d[i] = r%d;\n", regs[o], regs[o]);
    put(&b, "    }\n}\n");
    return b.p;
}

/* -- building ---------------------------------------------------------------------------- */

static int read_file(const char *path, Buf *b) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char tmp[4096];
    size_t k;
    while ((k = fread(tmp, 1, sizeof tmp, f)) > 0) put(b, "%.*s", (int)k, tmp);
    fclose(f);
    return 0;
}

static int mkdirs(const char *path) {
    char p[CMD_MAX];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++)
        if (*s == '/') {
            *s = 0;
            if (mkdir(p, 0755) && errno != EEXIST) return -1;
            *s = '/';
        }
    return mkdir(p, 0755) && errno != EEXIST ? -1 : 0;
}

static void fail(const char *fmt, ...) { /* under mu */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
}

static DvmFused load(const char *path, int *missing) {
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        *missing = 1;
        return NULL;
    }
    DvmFused fn = (DvmFused)dlsym(h, "dvm_fused");
    double *small = dlsym(h, "dvm_erf_small"), *large = dlsym(h, "dvm_erf_large");
    if (!fn || !small || !large) return NULL;
    memcpy(small, dvm_erf_small, sizeof dvm_erf_small);
    memcpy(large, dvm_erf_large, sizeof dvm_erf_large);
    return fn;
}

/* Run the compiler; 0 on success, else the first line of its output in `err`. */
static int run_compiler(const char *cmd, const char *log, char *err, size_t cap) {
    char buf[4 * CMD_MAX], *argv[64];
    int argc = 0;
    snprintf(buf, sizeof buf, "%s", cmd);
    for (char *t = strtok(buf, " "); t && argc < 63; t = strtok(NULL, " ")) argv[argc++] = t;
    argv[argc] = NULL;
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_adddup2(&fa, 1, 2);
    pid_t pid;
    int rc = posix_spawnp(&pid, argv[0], &fa, NULL, argv, environ), status = 0;
    posix_spawn_file_actions_destroy(&fa);
    if (rc) {
        snprintf(err, cap, "cannot run the C compiler %s: %s", argv[0], strerror(rc));
        return -1;
    }
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    if (WIFEXITED(status) && WEXITSTATUS(status) == 0) return 0;
    Buf out = {0};
    read_file(log, &out);
    char *nl = out.p ? strchr(out.p, '\n') : NULL;
    if (nl) *nl = 0;
    snprintf(err, cap, "%s failed: %s", argv[0], out.p ? out.p : "(no output)");
    free(out.p);
    return -1;
}

static DvmFused build(const Entry *e, const char *compiler, const char *dir, const char *src_dir, char *err,
                      size_t cap, int *from_disk) {
    char cmd[4 * CMD_MAX], path[2 * CMD_MAX], tmp[2 * CMD_MAX + 64], csrc[2 * CMD_MAX + 64], log[2 * CMD_MAX + 64];
    static atomic_int serial;
    char *src = program_source(e);
    Buf hdr = {0};
    char h1[2 * CMD_MAX], h2[2 * CMD_MAX];
    snprintf(h1, sizeof h1, "%s/elem.h", src_dir);
    snprintf(h2, sizeof h2, "%s/native.h", src_dir);
    DvmFused fn = NULL;
    if (!src || read_file(h1, &hdr) || read_file(h2, &hdr)) {
        snprintf(err, cap, "the kernel headers are not in %s", src_dir);
        goto out;
    }
    snprintf(cmd, sizeof cmd, "%s " FLAGS " %s -I%s", compiler, ISA_FLAGS[e->sig[0]], src_dir);
    uint64_t h = fnv(fnv(fnv(FNV0, hdr.p, hdr.n), cmd, strlen(cmd)), src, strlen(src));
    snprintf(path, sizeof path, "%s/dvm-%016llx.so", dir, (unsigned long long)h);
    int missing = 0;
    fn = load(path, &missing);
    if (fn || !missing) {
        *from_disk = 1;
        if (!fn) snprintf(err, cap, "%s has no kernel", path);
        goto out;
    }
    if (mkdirs(dir)) {
        snprintf(err, cap, "cannot create the cache directory %s: %s", dir, strerror(errno));
        goto out;
    }
    int k = atomic_fetch_add(&serial, 1);
    snprintf(tmp, sizeof tmp, "%s.%d.%d.tmp", path, (int)getpid(), k);
    snprintf(csrc, sizeof csrc, "%s/dvm-%016llx.%d.%d.c", dir, (unsigned long long)h, (int)getpid(), k);
    snprintf(log, sizeof log, "%s.log", csrc);
    FILE *f = fopen(csrc, "w");
    if (!f || fputs(src, f) < 0 || fclose(f)) {
        if (f) fclose(f);
        snprintf(err, cap, "cannot write %s", csrc);
        goto clean;
    }
    char full[8 * CMD_MAX];
    snprintf(full, sizeof full, "%s -o %s %s", cmd, tmp, csrc);
    if (run_compiler(full, log, err, cap)) goto clean;
    if (rename(tmp, path)) {
        snprintf(err, cap, "cannot rename %s: %s", tmp, strerror(errno));
        goto clean;
    }
    fn = load(path, &missing);
    if (!fn) snprintf(err, cap, "cannot load %s: %s", path, missing ? dlerror() : "no kernel in it");
clean:
    unlink(csrc);
    unlink(log);
    unlink(tmp);
out:
    free(src);
    free(hdr.p);
    return fn;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *worker(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (!queue_head) pthread_cond_wait(&work, &mu);
        Entry *e = queue_head;
        queue_head = e->queued;
        if (!queue_head) queue_tail = NULL;
        char compiler[CMD_MAX], dir[CMD_MAX], src_dir[CMD_MAX], err[512] = "";
        memcpy(compiler, cc, sizeof cc);
        memcpy(dir, cache, sizeof cache);
        memcpy(src_dir, native_dir, sizeof native_dir);
        pthread_mutex_unlock(&mu);
        double t0 = now();
        int from_disk = 0;
        DvmFused fn = build(e, compiler, dir, src_dir, err, sizeof err, &from_disk);
        double dt = now() - t0;
        pthread_mutex_lock(&mu);
        e->fn = fn;
        atomic_store(&e->state, fn ? READY : FAILED);
        if (!fn) n_failed++, fail("%s", err);
        else if (from_disk) n_loaded++;
        else n_built++, build_seconds += dt;
        if (--pending == 0) pthread_cond_broadcast(&idle);
    }
    return NULL;
}

static void after_fork_child(void) {
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&work, NULL);
    pthread_cond_init(&idle, NULL);
    worker_started = 0, pending = 0;
    queue_head = queue_tail = NULL;
    for (int i = 0; i < BUCKETS; i++)
        for (Entry *e = table[i]; e; e = e->next)
            if (atomic_load(&e->state) == QUEUED) atomic_store(&e->state, COLD), e->elements = 0;
}

static void enqueue(Entry *e) { /* under mu */
    if (!worker_started) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (rc) {
            atomic_store(&e->state, FAILED);
            n_failed++, fail("cannot start the compile thread");
            return;
        }
        worker_started = 1;
        if (!atfork_set) atfork_set = 1, pthread_atfork(NULL, NULL, after_fork_child);
    }
    e->queued = NULL;
    if (queue_tail) queue_tail->queued = e;
    else queue_head = e;
    queue_tail = e;
    pending++;
    pthread_cond_signal(&work);
}

/* -- lookup -------------------------------------------------------------------------------- */

DvmFused jit_lookup(int isa_index, const DvmInstr *code, int n_code, const DvmOperand *ops, int n_in, int n_ops,
                    int64_t elements) {
    int32_t head[3 + DVM_MAXOPS];
    head[0] = isa_index, head[1] = n_in, head[2] = n_ops;
    for (int o = 0; o < n_ops; o++) head[3 + o] = ops[o].reg;
    size_t n_head = (size_t)(3 + n_ops), n_code_i = (size_t)n_code * sizeof(DvmInstr) / sizeof(int32_t);
    uint64_t h = fnv(fnv(FNV0, head, n_head * 4), code, n_code_i * 4);
    if (atomic_load_explicit(&threshold, memory_order_relaxed) < 0) return NULL;
    Entry *e = table[h % BUCKETS];
    for (; e; e = e->next)
        if (e->hash == h && e->n_sig == (int)(n_head + n_code_i) && !memcmp(e->sig, head, n_head * 4)
            && !memcmp(e->sig + n_head, code, n_code_i * 4))
            break;
    if (e && atomic_load_explicit(&e->state, memory_order_acquire) == READY) return e->fn;
    if (e && atomic_load(&e->state) != COLD) return NULL;
    pthread_mutex_lock(&mu);
    configure();
    if (!enabled() || (!e && n_entries >= MAX_ENTRIES)) goto out;
    if (!e) {
        e = calloc(1, sizeof *e);
        int32_t *sig = malloc((n_head + n_code_i) * 4);
        if (!e || !sig) {
            free(e), free(sig);
            e = NULL;
            goto out;
        }
        memcpy(sig, head, n_head * 4);
        memcpy(sig + n_head, code, n_code_i * 4);
        e->hash = h, e->sig = sig, e->n_sig = (int)(n_head + n_code_i);
        e->next = table[h % BUCKETS];
        table[h % BUCKETS] = e;
        n_entries++;
    }
    e->elements += elements;
    if (e->elements >= threshold) {
        atomic_store(&e->state, QUEUED);
        enqueue(e);
    }
out:
    pthread_mutex_unlock(&mu);
    return NULL;
}

/* Wait until no compile is pending, at most `seconds`; 1 when none is. */
int jit_wait(double seconds) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    double end = (double)t.tv_sec + 1e-9 * (double)t.tv_nsec + seconds;
    struct timespec dl = {(time_t)end, (long)((end - (double)(time_t)end) * 1e9)};
    pthread_mutex_lock(&mu);
    int rc = 0;
    while (pending > 0 && rc != ETIMEDOUT) rc = pthread_cond_timedwait(&idle, &mu, &dl);
    int ok = pending == 0;
    pthread_mutex_unlock(&mu);
    return ok;
}
