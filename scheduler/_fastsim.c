/* Compiled event loop of megaloom.scheduler.Simulator for key-ordered policies.
 *
 * It replays exactly the Python loop of scheduler/simulator.py driven by the shared
 * Core (the specification): dependency counters from len(pred[t]); per-engine ready
 * queues, FIFO (the order tasks became ready) or a min-heap on (key[t], t); per-engine
 * free-unit stacks with unit 0 on top; a min-heap of (finish, dispatch sequence); every
 * free unit served in engine order before the clock moves; all completions of one
 * instant retired, in (finish, sequence) order, before dispatching again. Finish times
 * are `now + dur[t]` in IEEE double, as in Python, so the results are bit-identical.
 *
 * run(pred_ptr, succ_ptr, succ_idx, engine, dur, keys, units, progress, every)
 *   buffers (NumPy arrays): pred_ptr, int64[n + 1], CSR offsets of the predecessors (only the
 *   counts are read); succ_ptr, int64[n + 1], and succ_idx, int32, the successors in CSR form;
 *   engine, int32[n], the engine number of each task (units order); dur, float64[n]; keys,
 *   None (FIFO) or float64[n]. units: a list of unit counts per engine number; progress: None
 *   or a callable called as progress(done, total) every `every` dispatches and at the end.
 * Returns (start, unit, order, done): the bytes of float64 start and int32 unit per task and
 * int32 task ids in dispatch order (`done` of them). The caller checks what the loop must not
 * be given (NaN durations or keys, engines without units); bad sizes raise ValueError.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct { double t; int64_t seq; } Event;    /* completion: (finish, sequence) */
typedef struct { double key; int32_t tid; } Ready;  /* keyed ready entry: (key, tid) */

static inline int ev_less(const Event *a, const Event *b) {
    return a->t < b->t || (a->t == b->t && a->seq < b->seq);
}

static inline int rd_less(const Ready *a, const Ready *b) {
    return a->key < b->key || (a->key == b->key && a->tid < b->tid);
}

/* 0-based binary min-heaps; the two element types get one pair of functions each. */
#define HEAP_FUNCS(T, LESS)                                                   \
    static inline void T##_push(T *h, int64_t *len, T x) {                    \
        int64_t i = (*len)++;                                                 \
        while (i > 0) {                                                       \
            int64_t p = (i - 1) >> 1;                                         \
            if (!LESS(&x, &h[p])) break;                                      \
            h[i] = h[p];                                                      \
            i = p;                                                            \
        }                                                                     \
        h[i] = x;                                                             \
    }                                                                         \
    static inline T T##_pop(T *h, int64_t *len) {                             \
        T top = h[0], x = h[--(*len)];                                        \
        int64_t n = *len, i = 0;                                              \
        for (;;) {                                                            \
            int64_t c = 2 * i + 1;                                            \
            if (c >= n) break;                                                \
            if (c + 1 < n && LESS(&h[c + 1], &h[c])) c++;                     \
            if (!LESS(&h[c], &x)) break;                                      \
            h[i] = h[c];                                                      \
            i = c;                                                            \
        }                                                                     \
        if (n > 0) h[i] = x;                                                  \
        return top;                                                           \
    }

HEAP_FUNCS(Event, ev_less)
HEAP_FUNCS(Ready, rd_less)

typedef struct {
    Py_ssize_t n, ne;
    int64_t *off;      /* CSR successors: succ of t is adj[off[t]:off[t+1]] (borrowed, as eng, dur, key) */
    int32_t *adj;
    int64_t *unmet;    /* unmet predecessors per task */
    int32_t *eng;      /* engine number per task */
    double *dur, *key; /* key: NULL for FIFO */
    int64_t *qbase, *qhead, *qlen;  /* ready queue of engine e: q[qbase[e] ...] */
    int32_t *q;        /* FIFO entries */
    Ready *rq;         /* keyed entries */
    int64_t *fbase, *ftop;  /* free-unit stack of engine e: fu[fbase[e] : fbase[e] + ftop[e]] */
    int32_t *fu;
    Event *heap;
    int32_t *unit, *order;
    double *start;
} Sim;

static void sim_free(Sim *s) {
    PyMem_Free(s->unmet); PyMem_Free(s->qbase); PyMem_Free(s->qhead);
    PyMem_Free(s->qlen); PyMem_Free(s->q); PyMem_Free(s->rq); PyMem_Free(s->fbase);
    PyMem_Free(s->ftop); PyMem_Free(s->fu); PyMem_Free(s->heap); PyMem_Free(s->unit);
    PyMem_Free(s->order); PyMem_Free(s->start);
}

static inline void ready_push(Sim *s, int32_t t) {
    int32_t e = s->eng[t];
    if (s->key) {
        Ready r = {s->key[t], t};
        Ready_push(s->rq + s->qbase[e], &s->qlen[e], r);
    } else {
        s->q[s->qbase[e] + s->qhead[e] + s->qlen[e]++] = t;
    }
}

static inline int32_t ready_pop(Sim *s, int32_t e) {
    if (s->key) return Ready_pop(s->rq + s->qbase[e], &s->qlen[e]).tid;
    s->qlen[e]--;
    return s->q[s->qbase[e] + s->qhead[e]++];
}

static inline void retire(Sim *s, int32_t t) {
    int32_t e = s->eng[t];
    s->fu[s->fbase[e] + s->ftop[e]++] = s->unit[t];
    for (int64_t k = s->off[t]; k < s->off[t + 1]; k++) {
        int32_t v = s->adj[k];
        if (--s->unmet[v] == 0) ready_push(s, v);
    }
}

/* Check that buffer `b` holds `n` items of `size` bytes; -1 (ValueError) when not. */
static int sized(Py_buffer *b, Py_ssize_t n, Py_ssize_t size, const char *what) {
    if (b->len != n * size) {
        PyErr_Format(PyExc_ValueError, "%s has %zd bytes, expected %zd", what, b->len, n * size);
        return -1;
    }
    return 0;
}

/* Fill the Sim from the buffers; 0 = ok, -1 = error. */
static int sim_load(Sim *s, Py_buffer *pred_ptr, Py_buffer *succ_ptr, Py_buffer *succ_idx, Py_buffer *engine,
                    Py_buffer *dur, Py_buffer *keys, PyObject *units) {
    Py_ssize_t n = s->n, ne;
    PyObject *fu = PySequence_Fast(units, "units");
    if (fu == NULL) return -1;
    ne = s->ne = PySequence_Fast_GET_SIZE(fu);
    if (sized(pred_ptr, n + 1, 8, "pred_ptr") < 0 || sized(succ_ptr, n + 1, 8, "succ_ptr") < 0 ||
        sized(engine, n, 4, "engine") < 0 || sized(dur, n, 8, "dur") < 0 || (keys && sized(keys, n, 8, "keys") < 0))
        goto fail;
    const int64_t *pp = pred_ptr->buf, *sp = succ_ptr->buf;
    int64_t edges = sp[n];
    if (sized(succ_idx, edges, 4, "succ_idx") < 0) goto fail;
    s->off = (int64_t *)sp;
    s->adj = (int32_t *)succ_idx->buf;
    s->eng = (int32_t *)engine->buf;
    s->dur = (double *)dur->buf;
    s->key = keys ? (double *)keys->buf : NULL;
    s->unmet = PyMem_Malloc((n + 1) * sizeof(int64_t));
    s->qbase = PyMem_Calloc(ne + 1, sizeof(int64_t));
    s->qhead = PyMem_Calloc(ne + 1, sizeof(int64_t));
    s->qlen = PyMem_Calloc(ne + 1, sizeof(int64_t));
    s->fbase = PyMem_Calloc(ne + 1, sizeof(int64_t));
    s->ftop = PyMem_Calloc(ne + 1, sizeof(int64_t));
    s->unit = PyMem_Calloc(n + 1, sizeof(int32_t));  /* tasks that never start (a stall) keep 0 */
    s->order = PyMem_Malloc((n + 1) * sizeof(int32_t));
    s->start = PyMem_Calloc(n + 1, sizeof(double));
    if (keys) s->rq = PyMem_Malloc((n + 1) * sizeof(Ready));
    else s->q = PyMem_Malloc((n + 1) * sizeof(int32_t));
    if (!s->unmet || !s->qbase || !s->qhead || !s->qlen || !s->fbase || !s->ftop || !s->unit || !s->order ||
        !s->start || (!s->rq && !s->q)) { PyErr_NoMemory(); goto fail; }
    int64_t total_units = 0;  /* free-unit stacks, unit 0 on top */
    for (Py_ssize_t e = 0; e < ne; e++) {
        long long u = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fu, e));
        if (u == -1 && PyErr_Occurred()) goto fail;
        if (u <= 0 || u > INT32_MAX) { PyErr_SetString(PyExc_ValueError, "unit counts must be positive"); goto fail; }
        s->fbase[e] = total_units;
        s->ftop[e] = u;
        total_units += u;
    }
    s->fu = PyMem_Malloc((total_units + 1) * sizeof(int32_t));
    s->heap = PyMem_Malloc((total_units + 1) * sizeof(Event));
    if (!s->fu || !s->heap) { PyErr_NoMemory(); goto fail; }
    for (Py_ssize_t e = 0; e < ne; e++)
        for (int64_t i = 0; i < s->ftop[e]; i++) s->fu[s->fbase[e] + i] = (int32_t)(s->ftop[e] - 1 - i);
    for (Py_ssize_t t = 0; t < n; t++) {
        int32_t e = s->eng[t];
        if (e < 0 || e >= ne) { PyErr_Format(PyExc_ValueError, "task %zd has engine %d", t, e); goto fail; }
        s->qbase[e + 1]++;  /* tasks per engine; prefix-summed below */
        s->unmet[t] = pp[t + 1] - pp[t];
    }
    for (int64_t k = 0; k < edges; k++)
        if (s->adj[k] < 0 || s->adj[k] >= n) { PyErr_Format(PyExc_ValueError, "successor %d is not a task id", s->adj[k]); goto fail; }
    for (Py_ssize_t e = 0; e < ne; e++) s->qbase[e + 1] += s->qbase[e];
    Py_DECREF(fu);
    return 0;
fail:
    Py_DECREF(fu);
    return -1;
}

/* The event loop; 0 = ok, -1 = the progress callback raised. */
static int sim_loop(Sim *s, PyObject *progress, Py_ssize_t every, int64_t *ndone_out) {
    Py_ssize_t n = s->n;
    int64_t nd = 0, ndone = 0, hlen = 0, mark = progress != Py_None ? every : n + 1;
    double now = 0.0;
    for (Py_ssize_t t = 0; t < n; t++)  /* the Core queues initially ready tasks by id */
        if (s->unmet[t] == 0) ready_push(s, (int32_t)t);
    for (;;) {
        for (int32_t e = 0; e < s->ne; e++) {
            while (s->ftop[e] > 0 && s->qlen[e] > 0) {
                int32_t t = ready_pop(s, e);
                s->unit[t] = s->fu[s->fbase[e] + --s->ftop[e]];
                s->start[t] = now;
                Event x = {now + s->dur[t], nd};
                Event_push(s->heap, &hlen, x);
                s->order[nd++] = t;
            }
        }
        if (hlen == 0) break;
        if (nd >= mark) {
            PyObject *r = PyObject_CallFunction(progress, "nn", (Py_ssize_t)ndone, n);
            if (r == NULL) return -1;
            Py_DECREF(r);
            mark += every;
        }
        Event x = Event_pop(s->heap, &hlen);
        now = x.t;
        retire(s, s->order[x.seq]);
        ndone++;
        while (hlen > 0 && s->heap[0].t == now) {
            retire(s, s->order[Event_pop(s->heap, &hlen).seq]);
            ndone++;
        }
    }
    if (progress != Py_None) {
        PyObject *r = PyObject_CallFunction(progress, "nn", (Py_ssize_t)ndone, n);
        if (r == NULL) return -1;
        Py_DECREF(r);
    }
    *ndone_out = ndone;
    return 0;
}

/* (start, unit, order, done) as bytes: float64 start and int32 unit per task, int32 task ids in
 * dispatch order (`done` of them), for NumPy to read without a Python object per entry. */
static PyObject *sim_result_raw(Sim *s, int64_t ndone) {
    Py_ssize_t n = s->n;
    return Py_BuildValue("y#y#y#L", (const char *)s->start, (Py_ssize_t)(n * sizeof(double)),
                         (const char *)s->unit, (Py_ssize_t)(n * sizeof(int32_t)),
                         (const char *)s->order, (Py_ssize_t)(ndone * sizeof(int32_t)), (long long)ndone);
}

static PyObject *fastsim_run(PyObject *self, PyObject *args) {
    Py_buffer pp, sp, si, eng, dur, keys = {0};
    PyObject *keys_obj, *units, *progress, *out = NULL;
    Py_ssize_t every;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*y*y*OOOn:run", &pp, &sp, &si, &eng, &dur, &keys_obj, &units, &progress, &every))
        return NULL;
    Sim s;
    memset(&s, 0, sizeof s);
    s.n = eng.len / 4;
    if (progress != Py_None && !PyCallable_Check(progress))
        PyErr_SetString(PyExc_TypeError, "progress must be callable or None");
    else if (s.n >= INT32_MAX)
        PyErr_SetString(PyExc_ValueError, "too many tasks");
    else if (keys_obj == Py_None || PyObject_GetBuffer(keys_obj, &keys, PyBUF_SIMPLE) == 0) {
        int64_t ndone = 0;
        if (sim_load(&s, &pp, &sp, &si, &eng, &dur, keys.obj ? &keys : NULL, units) == 0 &&
            sim_loop(&s, progress, every < 1 ? 1 : every, &ndone) == 0)
            out = sim_result_raw(&s, ndone);
        if (keys.obj) PyBuffer_Release(&keys);
    }
    sim_free(&s);
    PyBuffer_Release(&pp); PyBuffer_Release(&sp); PyBuffer_Release(&si); PyBuffer_Release(&eng); PyBuffer_Release(&dur);
    return out;
}

/* A list of task ids (a list or tuple) as a borrowed fast sequence; -1 on error. */
static int task_ids(PyObject *seq, Py_ssize_t n, const char *what, PyObject **fast) {
    *fast = PySequence_Fast(seq, what);
    if (*fast == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(*fast) != n) {
        PyErr_Format(PyExc_ValueError, "%s has %zd entries, expected %zd", what, PySequence_Fast_GET_SIZE(*fast), n);
        return -1;
    }
    return 0;
}

/* upward_rank(succ, order, dur): rank[t] = dur[t] + max(rank[s] for s in succ[t]) (0.0 when
 * none), over `order` reversed; the same float operations, in the same order, as
 * megaloom.scheduler.policies.upward_rank. */
static PyObject *fastsim_upward_rank(PyObject *self, PyObject *args) {
    PyObject *succ, *order, *dur, *fs = NULL, *fo = NULL, *fd = NULL, *out = NULL;
    double *rank = NULL;
    (void)self;
    if (!PyArg_ParseTuple(args, "OOO:upward_rank", &succ, &order, &dur)) return NULL;
    Py_ssize_t n = PyObject_Length(succ);
    if (n < 0) return NULL;
    if (task_ids(succ, n, "succ", &fs) < 0 || task_ids(order, n, "order", &fo) < 0 ||
        task_ids(dur, n, "dur", &fd) < 0)
        goto done;
    rank = PyMem_Calloc(n + 1, sizeof(double));
    char *seen = PyMem_Calloc(n + 1, 1);
    if (!rank || !seen) { PyMem_Free(seen); PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        Py_ssize_t t = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(fo, i));
        if (t == -1 && PyErr_Occurred()) break;
        if (t < 0 || t >= n || seen[t]) {
            PyErr_Format(PyExc_ValueError, "order is not a permutation of the task ids (entry %zd: %zd)", i, t);
            break;
        }
        seen[t] = 1;
        PyObject *lst = PySequence_Fast_GET_ITEM(fs, t);
        if (!PyList_Check(lst)) { PyErr_Format(PyExc_TypeError, "succ of task %zd must be a list", t); break; }
        double m = 0.0;
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(lst); k++) {
            long v = PyLong_AsLong(PyList_GET_ITEM(lst, k));
            if (v == -1 && PyErr_Occurred()) goto loop_error;
            if (v < 0 || v >= n) {
                PyErr_Format(PyExc_ValueError, "successor %ld of task %zd is not a task id", v, t);
                goto loop_error;
            }
            if (k == 0 || rank[v] > m) m = rank[v];
        }
        double d = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(fd, t));
        if (d == -1.0 && PyErr_Occurred()) break;
        rank[t] = d + m;
    }
loop_error:
    PyMem_Free(seen);
    if (PyErr_Occurred()) goto done;
    out = PyList_New(n);
    if (!out) goto done;
    for (Py_ssize_t t = 0; t < n; t++) {
        PyObject *x = PyFloat_FromDouble(rank[t]);
        if (!x) { Py_CLEAR(out); goto done; }
        PyList_SET_ITEM(out, t, x);
    }
done:
    PyMem_Free(rank);
    Py_XDECREF(fs); Py_XDECREF(fo); Py_XDECREF(fd);
    return out;
}

static PyMethodDef methods[] = {
    {"run", fastsim_run, METH_VARARGS, "Simulate a key-ordered schedule; see the module source for arguments."},
    {"upward_rank", fastsim_upward_rank, METH_VARARGS, "Upward rank of every task; see the module source."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fastsim", "Compiled simulator event loop.", -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastsim(void) { return PyModule_Create(&module); }
