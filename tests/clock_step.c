/* A node's wall clock stepped: preloaded (LD_PRELOAD) into a process, adds
 * the seconds written in the file CLOCK_STEP_OFFSET_FILE names to what
 * CLOCK_REALTIME, gettimeofday() and time() answer. The monotonic clock is
 * left alone, as an NTP or operator's step leaves it. The file is read again
 * at most once a second (a clock read must stay cheap). tests/clock_step.py
 * builds it and writes the file. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/time.h>
#include <time.h>

static int (*real_clock_gettime)(clockid_t, struct timespec *);
static volatile long long offset_ns;
static volatile time_t read_at = -1;

static void resolve(void) {
    if (!real_clock_gettime)
        real_clock_gettime = (int (*)(clockid_t, struct timespec *))dlsym(RTLD_NEXT, "clock_gettime");
}

static long long current_offset_ns(void) {
    struct timespec now;
    const char *path = getenv("CLOCK_STEP_OFFSET_FILE");
    if (!path || real_clock_gettime(CLOCK_MONOTONIC, &now) != 0)
        return offset_ns;
    if (read_at >= 0 && now.tv_sec == read_at)
        return offset_ns;
    read_at = now.tv_sec;
    FILE *f = fopen(path, "r");
    if (f) {
        double seconds;
        if (fscanf(f, "%lf", &seconds) == 1)
            offset_ns = (long long)(seconds * 1e9);
        fclose(f);
    }
    return offset_ns;
}

static void shift(struct timespec *ts) {
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec + current_offset_ns();
    ts->tv_sec = (time_t)(ns / 1000000000LL);
    ts->tv_nsec = (long)(ns % 1000000000LL);
}

int clock_gettime(clockid_t id, struct timespec *ts) {
    resolve();
    int rc = real_clock_gettime(id, ts);
    if (rc == 0 && (id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE))
        shift(ts);
    return rc;
}

int gettimeofday(struct timeval *restrict tv, void *restrict tz) {
    struct timespec ts;
    (void)tz;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return -1;
    if (tv) {
        tv->tv_sec = ts.tv_sec;
        tv->tv_usec = ts.tv_nsec / 1000;
    }
    return 0;
}

time_t time(time_t *out) {
    struct timespec ts;
    if (clock_gettime(CLOCK_REALTIME, &ts) != 0)
        return (time_t)-1;
    if (out)
        *out = ts.tv_sec;
    return ts.tv_sec;
}
