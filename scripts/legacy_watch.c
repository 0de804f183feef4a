/* A watcher that needs no GIL (see capture_log.py): a thread asks the CUDA driver every ~10 us
   whether the legacy stream would join a capture (cuStreamIsCapturing(CU_STREAM_LEGACY) returns
   CUDA_ERROR_STREAM_CAPTURE_IMPLICIT, 906, while any blocking stream of the context captures) and
   keeps the CLOCK_MONOTONIC times of the first 256 such answers. Python's time.monotonic reads the
   same clock on Linux. Built by capture_log.py with: cc -O2 -shared -fPIC -ldl -lpthread */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#define KEPT 256
typedef int (*is_capturing_t)(void *, int *);
typedef int (*retain_t)(void **, int);
typedef int (*set_current_t)(void *);
static volatile int stop_flag;
static volatile long polls, hits, other_errors, last_other;
static volatile double hit_times[KEPT];
static pthread_t thread;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static void *loop(void *arg) {
    void *ctx = 0, *lib = dlopen("libcuda.so.1", RTLD_NOW);
    int status;
    if (!lib) { other_errors = -1; return 0; }
    retain_t retain = (retain_t)dlsym(lib, "cuDevicePrimaryCtxRetain");
    set_current_t set_current = (set_current_t)dlsym(lib, "cuCtxSetCurrent");
    is_capturing_t is_capturing = (is_capturing_t)dlsym(lib, "cuStreamIsCapturing");
    if (!retain || !set_current || !is_capturing || retain(&ctx, (int)(intptr_t)arg) ||
        set_current(ctx)) { other_errors = -1; return 0; }
    struct timespec pause = {0, 10000};
    while (!stop_flag) {
        int e = is_capturing((void *)0x1, &status); /* CU_STREAM_LEGACY */
        polls++;
        if (e == 906) { if (hits < KEPT) hit_times[hits] = now(); hits++; }
        else if (e) { other_errors++; last_other = e; }
        nanosleep(&pause, 0);
    }
    return 0;
}

/* Start watching the primary context of `device` (the caller made it already). */
int watch_start(int device) {
    stop_flag = 0;
    polls = hits = other_errors = 0;
    return pthread_create(&thread, 0, loop, (void *)(intptr_t)device);
}

/* out: polls, hits, other errors (-1: could not start), last other error; times: hit times. */
void watch_read(long *out, double *times) {
    out[0] = polls; out[1] = hits; out[2] = other_errors; out[3] = last_other;
    for (long i = 0; i < KEPT && i < hits; i++) times[i] = hit_times[i];
}

void watch_stop(void) { stop_flag = 1; pthread_join(thread, 0); }
