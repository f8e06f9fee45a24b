/*
 * test_cuda_kernels.c — every kernel of kernels/cuda/kn_cuda.h held to its CPU scalar reference
 * (kernels/cpu/ops_ref.c, quant_ref.c), then the speed table of `make gpu-check`
 * (scripts/gpu_check.sh).
 *
 * A plain program, not a Criterion suite: the GPU machine has no Criterion (docs/gpu.md). Without
 * a CUDA device it prints SKIP with the reason and exits 0. Method (the device entry's
 * METHOD.md): fresh random inputs every run (the seed is printed; KVMESH_GPU_SEED repeats one),
 * never zeros; outputs poisoned with NaN before each launch so an unwritten element fails;
 * ‖gpu − ref‖ / ‖ref‖ against a bound per kernel, NaN never passing; every CUDA call checked and
 * every launch synchronised and checked. Quantization must match the reference byte for byte.
 * The timings are medians of event-timed repetitions over buffers that together exceed the L2, as
 * GB/s of the bytes a kernel must move, next to the measured device-to-device copy bandwidth.
 * `--quick` skips the timings.
 */
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "kernels/cpu/internal.h"
#include "kernels/cuda/kn_cuda.h"

static int g_failed, g_checks;
static uint64_t g_rng;

#define CK(call)                                                                                   \
    do {                                                                                           \
        cudaError_t e_ = (call);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* A kn_cuda_* call: accepted, and its kernel ran to the end without error. */
#define KC(call)                                                                                   \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_) {                                                                                 \
            fprintf(stderr, "%s:%d: %s returned %d: %s\n", __FILE__, __LINE__, #call, rc_,         \
                    kn_cuda_last_error());                                                         \
            exit(1);                                                                               \
        }                                                                                          \
        CK(cudaDeviceSynchronize());                                                               \
    } while (0)

static uint64_t rnd(void)
{
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static float unit(void) /* [-1, 1) */
{
    return (float)(rnd() >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

static float *rand_f32(size_t n, float scale)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++) p[i] = scale * unit();
    return p;
}

static void *dev_upload(const void *h, size_t bytes)
{
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemcpy(d, h, bytes, cudaMemcpyHostToDevice));
    return d;
}

static void *dev_poisoned(size_t bytes)
{
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemset(d, 0xff, bytes)); /* NaN in every float */
    return d;
}

static void *host_download(const void *d, size_t bytes)
{
    void *h = malloc(bytes);
    CK(cudaMemcpy(h, d, bytes, cudaMemcpyDeviceToHost));
    return h;
}

/* ‖a − ref‖ / ‖ref‖ in double; infinity when a holds a NaN or an infinity. */
static double rel_err(const float *a, const float *ref, size_t n)
{
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        if (!isfinite(a[i])) return INFINITY;
        const double d = (double)a[i] - ref[i];
        num += d * d;
        den += (double)ref[i] * ref[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* The worst error per kernel, for the table. */
#define MAX_ROWS 16
static struct {
    char name[32];
    double err, gbs;
} g_rows[MAX_ROWS];
static int g_n_rows;

static void note(const char *kernel, double err)
{
    int i = 0;
    while (i < g_n_rows && strcmp(g_rows[i].name, kernel)) i++;
    if (i == g_n_rows) {
        if (g_n_rows == MAX_ROWS) return;
        snprintf(g_rows[g_n_rows].name, sizeof g_rows[0].name, "%s", kernel);
        g_rows[g_n_rows].err = 0, g_rows[g_n_rows++].gbs = -1;
    }
    if (err > g_rows[i].err || isnan(err)) g_rows[i].err = err;
}

static void check(const char *kernel, const char *shape, double err, double bound)
{
    const int ok = err <= bound; /* NaN fails */
    g_checks++;
    g_failed += !ok;
    note(kernel, err);
    printf("%s %-12s %-36s rel %.2e (bound %.0e)\n", ok ? "ok  " : "FAIL", kernel, shape, err,
           bound);
}

/* ---------------------------------------------------------------- element-wise and rows */

static void test_rmsnorm(int rows, int n)
{
    float *x = rand_f32((size_t)rows * n, 3.0f), *w = rand_f32(n, 1.0f);
    float *ref = malloc(sizeof(float) * rows * n);
    for (int r = 0; r < rows; r++)
        kn_rmsnorm_ref(ref + (size_t)r * n, x + (size_t)r * n, w, n, 1e-5f);
    float *dx = dev_upload(x, sizeof(float) * rows * n), *dw = dev_upload(w, sizeof(float) * n);
    float *dy = dev_poisoned(sizeof(float) * rows * n);
    KC(kn_cuda_rmsnorm(dy, dx, dw, rows, n, 1e-5f, NULL));
    float *y = host_download(dy, sizeof(float) * rows * n);
    char s[64];
    snprintf(s, sizeof s, "rows=%d n=%d", rows, n);
    check("rmsnorm", s, rel_err(y, ref, (size_t)rows * n), 1e-6);
    free(x), free(w), free(ref), free(y);
    CK(cudaFree(dx));
    CK(cudaFree(dw));
    CK(cudaFree(dy));
}

static void test_rope(int n_tok, int n_heads, int head_dim, int n_rot, int neox)
{
    const size_t n = (size_t)n_tok * n_heads * head_dim;
    float *x = rand_f32(n, 2.0f), *ref = malloc(sizeof(float) * n);
    int32_t *pos = malloc(sizeof(int32_t) * n_tok);
    float *cs = malloc(sizeof(float) * n_rot);
    memcpy(ref, x, sizeof(float) * n);
    for (int t = 0; t < n_tok; t++) {
        pos[t] = (int32_t)(rnd() % 16384);
        kn_rope_cache(cs, n_rot, pos[t], 10000.0f);
        kn_rope_ref(ref + (size_t)t * n_heads * head_dim, n_heads, head_dim, n_rot, cs, neox);
    }
    float *dx = dev_upload(x, sizeof(float) * n);
    int32_t *dpos = dev_upload(pos, sizeof(int32_t) * n_tok);
    KC(kn_cuda_rope(dx, n_tok, n_heads, head_dim, n_rot, dpos, 10000.0f, neox, NULL));
    float *y = host_download(dx, sizeof(float) * n);
    char s[64];
    snprintf(s, sizeof s, "tok=%d heads=%d hd=%d rot=%d %s", n_tok, n_heads, head_dim, n_rot,
             neox ? "neox" : "norm");
    check("rope", s, rel_err(y, ref, n), 1e-5);
    free(x), free(ref), free(pos), free(cs), free(y);
    CK(cudaFree(dx));
    CK(cudaFree(dpos));
}

static void test_silu_mul(int64_t n)
{
    float *g = rand_f32(n, 6.0f), *u = rand_f32(n, 2.0f), *ref = malloc(sizeof(float) * n);
    kn_silu_mul_ref(ref, g, u, (int)n);
    float *dg = dev_upload(g, sizeof(float) * n), *du = dev_upload(u, sizeof(float) * n);
    float *dy = dev_poisoned(sizeof(float) * n);
    KC(kn_cuda_silu_mul(dy, dg, du, n, NULL));
    float *y = host_download(dy, sizeof(float) * n);
    char s[64];
    snprintf(s, sizeof s, "n=%lld", (long long)n);
    check("silu_mul", s, rel_err(y, ref, n), 1e-6);
    free(g), free(u), free(ref), free(y);
    CK(cudaFree(dg));
    CK(cudaFree(du));
    CK(cudaFree(dy));
}

/* Softmax and argmax over rows of logits; the reference is double precision and en_argmax's rule
 * (the first index of the largest). */
static void test_softmax_argmax(int rows, int n, float temp)
{
    const size_t total = (size_t)rows * n;
    float *x = rand_f32(total, 12.0f), *ref = malloc(sizeof(float) * total);
    int32_t *ref_i = malloc(sizeof(int32_t) * rows);
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        double m = -INFINITY, s = 0;
        int32_t best = 0;
        for (int i = 0; i < n; i++) {
            m = fmax(m, (double)xr[i] / temp);
            if (xr[i] > xr[best]) best = i;
        }
        for (int i = 0; i < n; i++) s += exp((double)xr[i] / temp - m);
        for (int i = 0; i < n; i++) ref[(size_t)r * n + i] = (float)(exp(xr[i] / temp - m) / s);
        ref_i[r] = best;
    }
    float *dx = dev_upload(x, sizeof(float) * total), *dy = dev_poisoned(sizeof(float) * total);
    int32_t *di = dev_poisoned(sizeof(int32_t) * rows);
    KC(kn_cuda_softmax(dy, dx, rows, n, temp, NULL));
    KC(kn_cuda_argmax(di, dx, rows, n, NULL));
    float *y = host_download(dy, sizeof(float) * total);
    int32_t *idx = host_download(di, sizeof(int32_t) * rows);
    char s[64];
    snprintf(s, sizeof s, "rows=%d n=%d temp=%.2f", rows, n, temp);
    check("softmax", s, rel_err(y, ref, total), 1e-5);
    int wrong = 0;
    for (int r = 0; r < rows; r++) wrong += idx[r] != ref_i[r];
    check("argmax", s, wrong ? INFINITY : 0.0, 0.0);
    free(x), free(ref), free(ref_i), free(y), free(idx);
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(di));
}

/* ---------------------------------------------------------------- quantization, matvec */

/* Random weight rows in type t: 16-bit floats of spread 1/sqrt(k), or random bytes with each
 * block's scales (d, and Q4_K's dmin) set to sane values. */
static void *rand_weights(md_type t, int64_t rows, int64_t k)
{
    const size_t rb = md_type_row_bytes(t, k), bytes = rb * (size_t)rows;
    uint8_t *w = malloc(bytes);
    if (t == MD_TYPE_F16 || t == MD_TYPE_BF16) {
        kn_f16 *h = (kn_f16 *)w;
        for (size_t i = 0; i < bytes / 2; i++) {
            const float v = unit() / sqrtf((float)k);
            h[i] = t == MD_TYPE_F16 ? kn_f32_to_f16(v) : kn_f32_to_bf16(v);
        }
        return w;
    }
    for (size_t i = 0; i < bytes; i++) w[i] = (uint8_t)rnd();
    const size_t bb = (size_t)md_type_block_bytes(t);
    for (size_t i = 0; i < bytes; i += bb) {
        const kn_f16 d = kn_f32_to_f16((0.5f + 0.5f * fabsf(unit())) * 0.01f);
        memcpy(w + i, &d, 2);
        if (t == MD_TYPE_Q4_K) {
            const kn_f16 dmin = kn_f32_to_f16((0.5f + 0.5f * fabsf(unit())) * 0.005f);
            memcpy(w + i + 2, &dmin, 2);
        }
    }
    return w;
}

static double test_matvec(md_type wt, int64_t rows, int64_t k, int m)
{
    const md_type xt = kn_dot_type(wt);
    const size_t wrb = md_type_row_bytes(wt, k), xrb = md_type_row_bytes(xt, k);
    uint8_t *w = rand_weights(wt, rows, k);
    float *xf = rand_f32((size_t)m * k, 2.0f);
    uint8_t *xq = malloc(xrb * m);
    for (int i = 0; i < m; i++) kn_quantize_row_ref(xt, xf + (size_t)i * k, xq + i * xrb, k);
    float *ref = malloc(sizeof(float) * rows * m);
    kn_matmul_ref(wt, w, wrb, xq, xrb, k, m, ref, (size_t)rows, 0, rows);

    void *dw = dev_upload(w, wrb * rows);
    float *dxf = dev_upload(xf, sizeof(float) * m * k);
    uint8_t *dxq = dev_poisoned(xrb * m);
    float *dy = dev_poisoned(sizeof(float) * rows * m);
    KC(kn_cuda_quantize(xt, dxf, (size_t)k, dxq, xrb, k, m, NULL));
    uint8_t *gq = host_download(dxq, xrb * m);
    char s[80];
    snprintf(s, sizeof s, "%s rows=%d k=%d", md_type_name(xt), m, (int)k);
    check("quantize", s, memcmp(gq, xq, xrb * m) ? INFINITY : 0.0, 0.0);
    KC(kn_cuda_matvec(wt, dw, wrb, rows, k, dxq, xrb, m, dy, (size_t)rows, NULL));
    float *y = host_download(dy, sizeof(float) * rows * m);
    char name[32];
    snprintf(name, sizeof name, "matvec %s", md_type_name(wt));
    snprintf(s, sizeof s, "rows=%lld k=%lld m=%d", (long long)rows, (long long)k, m);
    const double err = rel_err(y, ref, (size_t)rows * m);
    check(name, s, err, 1e-5);
    free(w), free(xf), free(xq), free(ref), free(gq), free(y);
    CK(cudaFree(dw));
    CK(cudaFree(dxf));
    CK(cudaFree(dxq));
    CK(cudaFree(dy));
    return err;
}

/* ---------------------------------------------------------------- attention */

/* Decode attention over f16 pages laid out as kvshard lays one (layer, kv head) block out: a
 * 64-byte header, K [page_tokens][hd], then V; the pages are separate allocations. */
static void test_attention(int n_ctx, int hd, int n_q, int pt)
{
    const int n_pages = n_ctx / pt + 1;
    const size_t k_off = 64, v_off = 64 + (size_t)pt * hd * 2,
                 page_bytes = v_off + (size_t)pt * hd * 2;
    uint8_t **hp = malloc(sizeof *hp * n_pages), **dp = malloc(sizeof *dp * n_pages);
    for (int i = 0; i < n_pages; i++) {
        hp[i] = malloc(page_bytes);
        for (size_t j = 0; j < page_bytes; j += 2) {
            const kn_f16 h = kn_f32_to_f16(unit());
            memcpy(hp[i] + j, &h, 2);
        }
        dp[i] = dev_upload(hp[i], page_bytes);
    }
    float *q = rand_f32((size_t)n_q * hd, 2.0f), *ref = malloc(sizeof(float) * n_q * hd);
    const float scale = 1.0f / sqrtf((float)hd);
    kn_kv_view kv = {.pages = (const uint8_t *const *)hp,
                     .k_off = k_off,
                     .v_off = v_off,
                     .page_tokens = pt,
                     .n_ctx = n_ctx,
                     .format = KN_KV_F16};
    kn_attention_ref(&kv, hd, q, n_q, scale, ref);
    const uint8_t **dpages = dev_upload(dp, sizeof *dp * n_pages);
    float *dq = dev_upload(q, sizeof(float) * n_q * hd),
          *dout = dev_poisoned(sizeof(float) * n_q * hd);
    KC(kn_cuda_attention_f16(dpages, k_off, v_off, pt, n_ctx, hd, dq, n_q, scale, dout, NULL));
    float *out = host_download(dout, sizeof(float) * n_q * hd);
    char s[64];
    snprintf(s, sizeof s, "ctx=%d hd=%d heads=%d page=%d", n_ctx, hd, n_q, pt);
    check("attention f16", s, rel_err(out, ref, (size_t)n_q * hd), 1e-5);
    for (int i = 0; i < n_pages; i++) {
        free(hp[i]);
        CK(cudaFree(dp[i]));
    }
    free(hp), free(dp), free(q), free(ref), free(out);
    CK(cudaFree(dpages));
    CK(cudaFree(dq));
    CK(cudaFree(dout));
}

/* ---------------------------------------------------------------- timings */

static int cmp_f(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return x < y ? -1 : x > y;
}

/* Median of reps event-timed runs (after warm-ups) of fn(i), in seconds. */
static double time_median(void (*fn)(void *, int), void *ctx, int reps)
{
    cudaEvent_t a, b;
    CK(cudaEventCreate(&a));
    CK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) fn(ctx, i);
    CK(cudaDeviceSynchronize());
    float t[64];
    if (reps > 64) reps = 64;
    for (int i = 0; i < reps; i++) {
        CK(cudaEventRecord(a, NULL));
        fn(ctx, i);
        CK(cudaEventRecord(b, NULL));
        CK(cudaEventSynchronize(b));
        CK(cudaGetLastError());
        CK(cudaEventElapsedTime(&t[i], a, b));
    }
    CK(cudaEventDestroy(a));
    CK(cudaEventDestroy(b));
    qsort(t, reps, sizeof t[0], cmp_f);
    return t[reps / 2] * 1e-3;
}

typedef struct copy_ctx {
    void *src, *dst;
    size_t bytes;
} copy_ctx;

static void run_copy(void *c, int i)
{
    copy_ctx *x = c;
    CK(cudaMemcpyAsync(x->dst, x->src, x->bytes, cudaMemcpyDeviceToDevice, NULL));
}

/* Device-to-device copy of 1 GiB, bytes read plus bytes written. */
static double copy_gbs(void)
{
    copy_ctx c = {.bytes = (size_t)1 << 30};
    CK(cudaMalloc(&c.src, c.bytes));
    CK(cudaMalloc(&c.dst, c.bytes));
    CK(cudaMemset(c.src, 0x5a, c.bytes));
    const double s = time_median(run_copy, &c, 20);
    CK(cudaFree(c.src));
    CK(cudaFree(c.dst));
    return 2.0 * c.bytes / s / 1e9;
}

#define N_COPIES 4 /* weight sets rotated so repeated runs do not hit in L2 */

typedef struct mv_ctx {
    md_type wt;
    int64_t rows, k;
    int m;
    void *w[N_COPIES], *x;
    float *y;
} mv_ctx;

static void run_mv(void *c, int i)
{
    mv_ctx *v = c;
    const md_type xt = kn_dot_type(v->wt);
    int rc =
        kn_cuda_matvec(v->wt, v->w[i % N_COPIES], md_type_row_bytes(v->wt, v->k), v->rows, v->k,
                       v->x, md_type_row_bytes(xt, v->k), v->m, v->y, (size_t)v->rows, NULL);
    if (rc) {
        fprintf(stderr, "matvec: %d %s\n", rc, kn_cuda_last_error());
        exit(1);
    }
}

/* Weight bytes per second of a matvec of an 8B-class FFN shape (the weights dominate). */
static double matvec_gbs(md_type wt, int64_t rows, int64_t k, int m)
{
    mv_ctx v = {.wt = wt, .rows = rows, .k = k, .m = m};
    const size_t wb = md_type_row_bytes(wt, k) * rows, xb = md_type_row_bytes(kn_dot_type(wt), k);
    uint8_t *w = rand_weights(wt, rows, k);
    for (int i = 0; i < N_COPIES; i++) v.w[i] = dev_upload(w, wb);
    float *xf = rand_f32((size_t)m * k, 1.0f);
    float *dxf = dev_upload(xf, sizeof(float) * m * k);
    CK(cudaMalloc(&v.x, xb * m));
    CK(cudaMalloc((void **)&v.y, sizeof(float) * rows * m));
    KC(kn_cuda_quantize(kn_dot_type(wt), dxf, (size_t)k, v.x, xb, k, m, NULL));
    const double s = time_median(run_mv, &v, 40);
    for (int i = 0; i < N_COPIES; i++) CK(cudaFree(v.w[i]));
    CK(cudaFree(v.x));
    CK(cudaFree(v.y));
    CK(cudaFree(dxf));
    free(w), free(xf);
    return wb / s / 1e9;
}

/* The table `make gpu-check` prints last. */
static void print_table(FILE *f, const char *desc, double bw)
{
    fprintf(f, "test_cuda_kernels on %s\n", desc);
    fprintf(f, "device-to-device copy: %.0f GB/s (read + write, 1 GiB, median of 20)\n", bw);
    fprintf(f, "%-14s %-12s %-8s %-8s %s\n", "kernel", "max rel err", "GB/s", "of copy",
            "timed on (random weights: speed only)");
    for (int i = 0; i < g_n_rows; i++) {
        if (g_rows[i].gbs > 0)
            fprintf(f, "%-14s %-12.2e %-8.0f %5.1f%%   14336 x 4096, m=1, weight bytes\n",
                    g_rows[i].name, g_rows[i].err, g_rows[i].gbs, 100.0 * g_rows[i].gbs / bw);
        else
            fprintf(f, "%-14s %-12.2e %-8s %-8s\n", g_rows[i].name, g_rows[i].err, "-", "-");
    }
}

int main(int argc, char **argv)
{
    const int quick = argc > 1 && !strcmp(argv[1], "--quick");
    char desc[256];
    const int n = kn_cuda_devices(desc, sizeof desc);
    if (n <= 0) {
        printf("test_cuda_kernels: SKIP: %s\n", desc);
        return 0;
    }
    const char *seed_env = getenv("KVMESH_GPU_SEED");
    g_rng =
        seed_env ? strtoull(seed_env, NULL, 0) : (uint64_t)time(NULL) ^ (uint64_t)getpid() << 32;
    printf("test_cuda_kernels: %s; seed %llu (KVMESH_GPU_SEED repeats it)\n", desc,
           (unsigned long long)g_rng);

    test_rmsnorm(3, 576), test_rmsnorm(2, 4096), test_rmsnorm(5, 1000);
    test_rope(5, 9, 64, 64, 0), test_rope(3, 32, 128, 128, 1), test_rope(2, 4, 128, 64, 0);
    test_silu_mul(1536), test_silu_mul(14336 * 3 + 7);
    test_softmax_argmax(3, 49152, 1.0f), test_softmax_argmax(2, 128256, 0.7f);
    test_softmax_argmax(4, 1000, 1.0f);
    const md_type types[] = {MD_TYPE_F16, MD_TYPE_BF16, MD_TYPE_Q8_0, MD_TYPE_Q4_0, MD_TYPE_Q4_K};
    for (size_t t = 0; t < sizeof types / sizeof types[0]; t++) {
        test_matvec(types[t], 576, md_type_block_elems(types[t]) == 256 ? 512 : 576, 1);
        test_matvec(types[t], 1001, 1536, 3);
        test_matvec(types[t], 4096, 4096, 1);
        test_matvec(types[t], 2048, 8192, KN_CUDA_MAX_M);
    }

    test_attention(1, 64, 3, 16), test_attention(17, 64, 3, 16), test_attention(300, 128, 4, 16);
    test_attention(1000, 128, 8, 32), test_attention(77, 256, 2, 16);

    if (!quick && !g_failed) {
        const double bw = copy_gbs();
        for (int i = 0; i < g_n_rows; i++) {
            const char *nm = g_rows[i].name;
            if (strncmp(nm, "matvec ", 7)) continue;
            md_type wt = MD_TYPE_F16;
            for (size_t t = 0; t < sizeof types / sizeof types[0]; t++)
                if (!strcmp(nm + 7, md_type_name(types[t]))) wt = types[t];
            g_rows[i].gbs = matvec_gbs(wt, 14336, 4096, 1);
        }
        print_table(stdout, desc, bw);
        const char *path = getenv("KVMESH_GPU_TABLE");
        FILE *f = path ? fopen(path, "a") : NULL;
        if (f) print_table(f, desc, bw), fclose(f);
    }
    printf("\ntest_cuda_kernels: %d checks, %d failed\n", g_checks, g_failed);
    return g_failed ? 1 : 0;
}
