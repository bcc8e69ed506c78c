/* A small persistent pthread pool for megaloom.ops._native.
 *
 * pool_run(n, grain, threads, fn, ctx) calls fn(ctx, begin, end) over [0, n) in chunks of
 * `grain` taken from a shared atomic counter (dynamic scheduling: a worker slowed down by
 * other processes on a shared machine simply takes fewer chunks). The calling thread works
 * too. One job runs at a time; a caller that finds the pool busy (another Python thread
 * running a kernel with the GIL released) runs its job alone on its own thread instead of
 * waiting. Workers sleep on a condition variable between jobs. After fork() the child
 * starts with no workers and creates new ones on demand.
 */
#include "pool.h"

#include <pthread.h>
#include <stdatomic.h>
#include <unistd.h>

#define POOL_MAX 64

typedef struct {
    pool_fn fn;
    void *ctx;
    int64_t n, grain;
    int threads;
    atomic_llong next;
} Job;

static pthread_mutex_t busy = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t wake = PTHREAD_COND_INITIALIZER, done = PTHREAD_COND_INITIALIZER;
static int started;        /* workers alive */
static uint64_t generation; /* bumped per job */
static uint64_t seen0[POOL_MAX];
static Job *current;        /* valid while its participants run: the caller waits for them */
static int current_threads; /* threads of the current job, the caller's included */
static int pending;
static int atfork_set;

static void drain(Job *j) {
    for (;;) {
        int64_t b = atomic_fetch_add(&j->next, j->grain);
        if (b >= j->n) return;
        j->fn(j->ctx, b, b + j->grain < j->n ? b + j->grain : j->n);
    }
}

static void *worker(void *arg) {
    int idx = (int)(intptr_t)arg;
    pthread_mutex_lock(&mu);
    uint64_t seen = seen0[idx];
    for (;;) {
        while (generation == seen) pthread_cond_wait(&wake, &mu);
        seen = generation;
        if (idx + 1 >= current_threads) continue; /* not in this job: never touch it (it may be gone) */
        Job *j = current;
        pthread_mutex_unlock(&mu);
        drain(j);
        pthread_mutex_lock(&mu);
        if (--pending == 0) pthread_cond_signal(&done);
    }
    return NULL;
}

static void child_after_fork(void) {
    /* only the forking thread exists in the child: forget the workers and the locks' state */
    pthread_mutex_init(&busy, NULL);
    pthread_mutex_init(&mu, NULL);
    pthread_cond_init(&wake, NULL);
    pthread_cond_init(&done, NULL);
    started = 0;
    pending = 0;
    current = NULL;
    current_threads = 0;
}

/* Start workers up to `want`; returns how many are alive (fewer if creation fails). */
static int ensure_workers(int want) {
    if (!atfork_set) {
        pthread_atfork(NULL, NULL, child_after_fork);
        atfork_set = 1;
    }
    while (started < want && started < POOL_MAX) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        seen0[started] = generation;
        int rc = pthread_create(&t, &attr, worker, (void *)(intptr_t)started);
        pthread_attr_destroy(&attr);
        if (rc != 0) break;
        started++;
    }
    return started;
}

int pool_max_threads(void) { return POOL_MAX + 1; }

void pool_run(int64_t n, int64_t grain, int threads, pool_fn fn, void *ctx) {
    Job j = {fn, ctx, n, grain < 1 ? 1 : grain, 1, 0};
    atomic_init(&j.next, 0);
    if (threads <= 1 || n <= j.grain || pthread_mutex_trylock(&busy) != 0) {
        drain(&j);
        return;
    }
    pthread_mutex_lock(&mu);
    int workers = ensure_workers(threads - 1);
    j.threads = workers + 1 < threads ? workers + 1 : threads;
    current = &j;
    current_threads = j.threads;
    pending = j.threads - 1;
    generation++;
    pthread_cond_broadcast(&wake);
    pthread_mutex_unlock(&mu);
    drain(&j);
    pthread_mutex_lock(&mu);
    while (pending > 0) pthread_cond_wait(&done, &mu);
    current = NULL;
    current_threads = 0;
    pthread_mutex_unlock(&mu);
    pthread_mutex_unlock(&busy);
}
