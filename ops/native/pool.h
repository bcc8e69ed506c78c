/* Persistent worker threads of megaloom.ops._native (pool.c). */
#ifndef MEGALOOM_POOL_H
#define MEGALOOM_POOL_H

#include <stdint.h>

typedef void (*pool_fn)(void *ctx, int64_t begin, int64_t end);

/* fn over [0, n) in chunks of grain on up to `threads` threads (the caller's included). */
void pool_run(int64_t n, int64_t grain, int threads, pool_fn fn, void *ctx);
int pool_max_threads(void);

#endif
