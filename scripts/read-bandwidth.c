// A reference memory read bandwidth reader, to check brigade's probe against (see
// scripts/compare-bandwidth.sh): each of T threads sums its share of a buffer of B MiB with
// 512-bit (or, without AVX-512, 256-bit) loads into eight accumulators; the best of R passes.
// Build: cc -O2 -march=native -pthread read-bandwidth.c -o read-bandwidth
// Usage: read-bandwidth [threads=2] [MiB=512] [passes=5]
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const char *p;
    size_t n;
    pthread_barrier_t *start;
    uint64_t sink;
} job_t;

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *reader(void *arg) {
    job_t *j = arg;
    pthread_barrier_wait(j->start);
#if defined(__AVX512F__)
    __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0; i + 512 <= j->n; i += 512) {
        const char *q = j->p + i;
        a0 = _mm512_add_epi64(a0, _mm512_load_si512(q));
        a1 = _mm512_add_epi64(a1, _mm512_load_si512(q + 64));
        a2 = _mm512_add_epi64(a2, _mm512_load_si512(q + 128));
        a3 = _mm512_add_epi64(a3, _mm512_load_si512(q + 192));
        a4 = _mm512_add_epi64(a4, _mm512_load_si512(q + 256));
        a5 = _mm512_add_epi64(a5, _mm512_load_si512(q + 320));
        a6 = _mm512_add_epi64(a6, _mm512_load_si512(q + 384));
        a7 = _mm512_add_epi64(a7, _mm512_load_si512(q + 448));
    }
    __m512i s = _mm512_add_epi64(_mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)),
                                 _mm512_add_epi64(_mm512_add_epi64(a4, a5), _mm512_add_epi64(a6, a7)));
    j->sink = _mm512_reduce_add_epi64(s);
#else
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (size_t i = 0; i + 256 <= j->n; i += 256) {
        const char *q = j->p + i;
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)q));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(q + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(q + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(q + 96)));
        a4 = _mm256_add_epi64(a4, _mm256_load_si256((const __m256i *)(q + 128)));
        a5 = _mm256_add_epi64(a5, _mm256_load_si256((const __m256i *)(q + 160)));
        a6 = _mm256_add_epi64(a6, _mm256_load_si256((const __m256i *)(q + 192)));
        a7 = _mm256_add_epi64(a7, _mm256_load_si256((const __m256i *)(q + 224)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)),
                                 _mm256_add_epi64(_mm256_add_epi64(a4, a5), _mm256_add_epi64(a6, a7)));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s);
    j->sink = lanes[0] + lanes[1] + lanes[2] + lanes[3];
#endif
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 2;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 512;
    int passes = argc > 3 ? atoi(argv[3]) : 5;
    if (threads < 1 || threads > 256 || mib < 1 || passes < 1) {
        fprintf(stderr, "usage: %s [threads] [MiB] [passes]\n", argv[0]);
        return 2;
    }
    size_t bytes = mib << 20;
    char *buf = aligned_alloc(4096, bytes);
    if (!buf) {
        perror("aligned_alloc");
        return 1;
    }
    for (size_t i = 0; i < bytes; i += 8) {
        uint64_t v = (uint64_t)i * 0x9E3779B97F4A7C15ull;
        memcpy(buf + i, &v, 8);
    }
    size_t share = (bytes / threads) & ~(size_t)4095;
    double best = 0;
    uint64_t sink = 0;
    for (int r = 0; r < passes; r++) {
        pthread_t t[256];
        job_t jobs[256];
        pthread_barrier_t start;
        pthread_barrier_init(&start, NULL, threads + 1);
        for (int i = 0; i < threads; i++) {
            jobs[i] = (job_t){buf + i * share, share, &start, 0};
            pthread_create(&t[i], NULL, reader, &jobs[i]);
        }
        pthread_barrier_wait(&start);
        double t0 = now();
        for (int i = 0; i < threads; i++) {
            pthread_join(t[i], NULL);
            sink += jobs[i].sink;
        }
        double dt = now() - t0;
        pthread_barrier_destroy(&start);
        double gbs = (double)share * threads / dt / 1e9;
        if (gbs > best) best = gbs;
    }
    printf("%.2f GB/s (C reader, %s, %d threads, %zu MiB, best of %d; sink %llu)\n", best,
#if defined(__AVX512F__)
           "avx512",
#else
           "avx2",
#endif
           threads, mib, passes, (unsigned long long)(sink & 1));
    free(buf);
    return 0;
}
