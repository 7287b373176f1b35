// The two history loops of attention on the codes (hybrid_cache/code_attention.py), for x86-64 with AVX-512 VNNI:
// built and loaded by hybrid_cache/code_kernel.py, which checks every shape, stride and dtype before calling.
//
// hc_scores: for every history token t and query row r, row_constant[r] plus the sum over groups g of
//     key_scale[t, g] * query_weight[r, g] * (codes[t, g] . query[r, g])
// with exact int32 dot products: vpdpbusd multiplies unsigned by signed bytes, so the codes are read as c + 128
// (a flipped sign bit) and 128 * sum(query[r, g]) is taken off again. Rows r >= out_rows add into row r % out_rows
// (the second part of a two-part query).
// hc_values: for every query row j, sum over t of prob[j, t] * value_scale[t, g] * factor * codes[t, g], in float32,
// into one partial sum per (batch, head, split) that the caller adds up.
//
// Codes: int8 [.., L, D] with channels contiguous, or int4 [.., L, D / 2] (channel j in the low nibble of byte j,
// channel j + D / 2 in the high nibble), read as 16 x the nibble. D and the group size are multiples of 64
// (int4: D a multiple of 128), so that every 64-channel block lies in one group and in one half of the bytes.
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define BLOCK 64
#define MAX_BLOCKS 16
#define MAX_THREADS 256

enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 };

static inline float load_scale(const void *base, int64_t index, int64_t dtype) {
    if (dtype == SCALE_F32) return ((const float *)base)[index];
    uint16_t half = ((const uint16_t *)base)[index];
    if (dtype == SCALE_F16) return _cvtsh_ss(half);
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

// Block k (channels 64k .. 64k + 63) of one token, as int8 (int4: 16 x the nibble).
static inline __m512i load_block(const int8_t *row, int64_t k, int64_t half, int64_t int4) {
    if (!int4) return _mm512_loadu_si512((const void *)(row + k * BLOCK));
    const __m512i high_nibbles = _mm512_set1_epi8((char)0xF0);
    int64_t byte = k * BLOCK;
    if (byte < half)
        return _mm512_and_si512(_mm512_slli_epi16(_mm512_loadu_si512((const void *)(row + byte)), 4), high_nibbles);
    return _mm512_and_si512(_mm512_loadu_si512((const void *)(row + byte - half)), high_nibbles);
}

typedef struct {
    const int8_t *codes;
    int64_t code_strides[3];  // batch, head, token (bytes)
    const void *scales;
    int64_t scale_strides[3];  // batch, head, token (elements); groups contiguous
    int64_t scale_dtype;
    int64_t batch, heads, length, dim, groups, int4, splits, threads;
    // hc_scores
    const int8_t *query;         // [B, H, rows, D] contiguous
    const float *query_weights;  // [B, H, rows, G] contiguous
    int64_t rows, out_rows;
    const float *row_constants;  // [B, H, out_rows], added to every score of the row
    float *scores;  // [B, H, out_rows, L] with the strides below (elements), tokens contiguous
    int64_t score_strides[3];
    // hc_values
    const float *probs;  // [B, H, out_rows, *]: strides below (elements), tokens contiguous
    int64_t prob_strides[3];
    float factor;
    float *partial;  // [B, H, splits, out_rows, D] contiguous
} Job;

// Lane i of the result: the sum of the 16 lanes of v[i] (a transpose-and-add tree, 45 operations for 16 sums).
static inline __m512i sum_lanes16(const __m512i v[16]) {
    __m512i pairs[8], quads[4], halves[2];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
        pairs[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]),
                                    _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // per 128-bit lane k: the lane-k sums of v[4i .. 4i + 3]
        quads[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(pairs[2 * i], pairs[2 * i + 1]),
                                    _mm512_unpackhi_epi64(pairs[2 * i], pairs[2 * i + 1]));
    for (int i = 0; i < 2; i++)
        halves[i] = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0x88),
                                     _mm512_shuffle_i32x4(quads[2 * i], quads[2 * i + 1], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(halves[0], halves[1], 0x88),
                            _mm512_shuffle_i32x4(halves[0], halves[1], 0xDD));
}

// The group scales of one token as 16 float32 lanes (lanes >= groups are 0).
static inline __m512 load_scales16(const void *base, int64_t index, int64_t groups, int64_t dtype) {
    __mmask16 valid = (__mmask16)((1u << groups) - 1u);
    if (dtype == SCALE_F32) return _mm512_maskz_loadu_ps(valid, (const float *)base + index);
    __m256i half = _mm256_maskz_loadu_epi16(valid, (const uint16_t *)base + index);
    if (dtype == SCALE_F16) return _mm512_cvtph_ps(half);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Scores of tokens t0 .. t1 - 1 of one (batch, head). The (row, group) dot products are formed 16 at a time (chunk
// c holds pairs 16c .. 16c + 15, pair i = row i / G, group i % G), summed lane-wise by one tree, offset, converted
// and weighted in one vector each; the groups of a row are then added up.
static inline __attribute__((always_inline)) void scores_body(const Job *a, int64_t bh, int64_t t0, int64_t t1,
                                                               const int64_t G, const int64_t R, const int64_t per_group) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    int64_t m = a->out_rows;
    int64_t blocks = G * per_group, D = blocks * BLOCK, half = D / 2;
    int64_t pairs = R * G, chunks = (pairs + 15) / 16;
    const int8_t *codes = a->codes + b * a->code_strides[0] + h * a->code_strides[1];
    int64_t scale_base = b * a->scale_strides[0] + h * a->scale_strides[1];
    const int8_t *query = a->query + bh * R * D;
    const float *weights = a->query_weights + bh * R * G;
    const float *constants = a->row_constants + bh * m;
    float *out = a->scores + b * a->score_strides[0] + h * a->score_strides[1];
    int32_t offsets[chunks * 16];  // 128 * the sum of each (row, group) of the query's codes; 0 for padding
    float pair_weights[chunks * 16];
    int32_t group_of[chunks * 16];
    for (int64_t i = 0; i < chunks * 16; i++) {
        int32_t sum = 0;
        if (i < pairs)
            for (int64_t c = 0; c < per_group * BLOCK; c++)
                sum += query[(i / G) * D + (i % G) * per_group * BLOCK + c];
        offsets[i] = 128 * sum;
        pair_weights[i] = i < pairs ? weights[i] : 0.0f;
        group_of[i] = (int32_t)(i < pairs ? i % G : 0);
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    __m512i unsigned_codes[MAX_BLOCKS], dots[16];
    float products[16], row_sums[R];
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *row = codes + t * a->code_strides[2];
        for (int64_t k = 0; k < blocks; k++)
            unsigned_codes[k] = _mm512_xor_si512(load_block(row, k, half, a->int4), flip);
        __m512 token_scales = load_scales16(a->scales, scale_base + t * a->scale_strides[2], G, a->scale_dtype);
        for (int64_t r = 0; r < R; r++) row_sums[r] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t l = 0; l < 16; l++) {
                int64_t i = c * 16 + l;
                __m512i dot = _mm512_setzero_si512();
                if (i < pairs) {
                    int64_t r = i / G, g = i % G;
                    for (int64_t k = g * per_group; k < (g + 1) * per_group; k++)
                        dot = _mm512_dpbusd_epi32(dot, unsigned_codes[k],
                                                  _mm512_loadu_si512((const void *)(query + r * D + k * BLOCK)));
                }
                dots[l] = dot;
            }
            __m512i exact = _mm512_sub_epi32(sum_lanes16(dots), _mm512_loadu_si512((const void *)(offsets + c * 16)));
            __m512 scale = _mm512_permutexvar_ps(_mm512_loadu_si512((const void *)(group_of + c * 16)), token_scales);
            scale = _mm512_mul_ps(scale, _mm512_loadu_ps(pair_weights + c * 16));
            _mm512_storeu_ps(products, _mm512_mul_ps(_mm512_cvtepi32_ps(exact), scale));
            for (int64_t l = 0; l < 16 && c * 16 + l < pairs; l++) row_sums[(c * 16 + l) / G] += products[l];
        }
        for (int64_t r = 0; r < R; r++) {
            if (r < m) out[r * a->score_strides[2] + t] = row_sums[r] + constants[r];
            else out[(r % m) * a->score_strides[2] + t] += row_sums[r];
        }
    }
}

static void scores_item(const Job *a, int64_t bh, int64_t t0, int64_t t1) {
    int64_t G = a->groups, R = a->rows, per_group = a->dim / BLOCK / a->groups;
    if (per_group == 1 && G == 4 && R == 4) scores_body(a, bh, t0, t1, 4, 4, 1);
    else if (per_group == 1 && G == 4 && R == 8) scores_body(a, bh, t0, t1, 4, 8, 1);
    else if (per_group == 1 && G == 8 && R == 4) scores_body(a, bh, t0, t1, 8, 4, 1);
    else if (per_group == 1 && G == 8 && R == 8) scores_body(a, bh, t0, t1, 8, 8, 1);
    else scores_body(a, bh, t0, t1, G, R, per_group);
}

static inline void block_to_float(const int8_t *row, int64_t k, int64_t half, int64_t int4, __m512 f[4]) {
    if (!int4) {  // sign-extending loads straight from memory
        const int8_t *src = row + k * BLOCK;
        for (int i = 0; i < 4; i++)
            f[i] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16 * i))));
        return;
    }
    __m512i x = load_block(row, k, half, int4);
    f[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_castsi512_si128(x)));
    f[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 1)));
    f[2] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 2)));
    f[3] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(x, 3)));
}

// Tokens per tile of the value sum: each tile's codes are read from memory once (block by block from the caches).
#define VALUE_TILE 128

static inline __attribute__((always_inline)) void values_body(const Job *a, int64_t bh, int64_t split, int64_t t0,
                                                               int64_t t1, const int64_t m, const int64_t blocks) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    int64_t G = a->groups, per_group = blocks / G, D = blocks * BLOCK, half = D / 2;
    const int8_t *codes = a->codes + b * a->code_strides[0] + h * a->code_strides[1];
    int64_t scale_base = b * a->scale_strides[0] + h * a->scale_strides[1];
    const float *probs = a->probs + b * a->prob_strides[0] + h * a->prob_strides[1];
    float *out = a->partial + (bh * a->splits + split) * m * D;
    memset(out, 0, sizeof(float) * m * D);
    for (int64_t tile = t0; tile < t1; tile += VALUE_TILE) {
        int64_t end = tile + VALUE_TILE < t1 ? tile + VALUE_TILE : t1;
        for (int64_t k = 0; k < blocks; k++) {
            int64_t g = k / per_group;
            for (int64_t j0 = 0; j0 < m; j0 += 4) {
                int64_t rows = m - j0 < 4 ? m - j0 : 4;
                __m512 acc[4][4];
                for (int64_t j = 0; j < 4; j++)
                    for (int i = 0; i < 4; i++)
                        acc[j][i] = j < rows ? _mm512_loadu_ps(out + (j0 + j) * D + k * BLOCK + 16 * i)
                                             : _mm512_setzero_ps();
                for (int64_t t = tile; t < end; t++) {
                    __m512 f[4];
                    block_to_float(codes + t * a->code_strides[2], k, half, a->int4, f);
                    float scale =
                        a->factor * load_scale(a->scales, scale_base + t * a->scale_strides[2] + g, a->scale_dtype);
                    for (int64_t j = 0; j < rows; j++) {
                        __m512 weight = _mm512_set1_ps(probs[(j0 + j) * a->prob_strides[2] + t] * scale);
                        for (int i = 0; i < 4; i++) acc[j][i] = _mm512_fmadd_ps(f[i], weight, acc[j][i]);
                    }
                }
                for (int64_t j = 0; j < rows; j++)
                    for (int i = 0; i < 4; i++) _mm512_storeu_ps(out + (j0 + j) * D + k * BLOCK + 16 * i, acc[j][i]);
            }
        }
    }
}

static void values_item(const Job *a, int64_t bh, int64_t split, int64_t t0, int64_t t1) {
    int64_t m = a->out_rows, blocks = a->dim / BLOCK;
    if (m == 4 && blocks == 4) values_body(a, bh, split, t0, t1, 4, 4);
    else if (m == 8 && blocks == 4) values_body(a, bh, split, t0, t1, 8, 4);
    else if (m == 4 && blocks == 8) values_body(a, bh, split, t0, t1, 4, 8);
    else if (m == 8 && blocks == 8) values_body(a, bh, split, t0, t1, 8, 8);
    else values_body(a, bh, split, t0, t1, m, blocks);
}

// Work items are (batch x head, split) pairs, each a contiguous range of tokens; thread i of n takes items i, i + n, ...
static void run_items(const Job *a, int scores, int64_t thread) {
    int64_t chunk = (a->length + a->splits - 1) / a->splits;
    for (int64_t item = thread; item < a->batch * a->heads * a->splits; item += a->threads) {
        int64_t bh = item / a->splits, split = item % a->splits;
        int64_t t0 = split * chunk < a->length ? split * chunk : a->length;
        int64_t t1 = t0 + chunk < a->length ? t0 + chunk : a->length;
        if (scores) scores_item(a, bh, t0, t1);
        else values_item(a, bh, split, t0, t1);
    }
}

// A pool of worker threads kept between calls: starting a thread costs about 130 us on the machine this was measured
// on (docs/quantization.md), more than a batch-1 call's work. Workers sleep on a condition variable; a call publishes
// its job under a new generation, runs thread 0's items itself and waits until the workers it used are done. Calls
// are serialized (one job at a time). After fork() the child starts with no workers (its own pool on first use).
static struct {
    pthread_mutex_t call, lock;
    pthread_cond_t start, done;
    int64_t generation, active, pending, workers;
    const Job *job;
    int scores;
} pool = {.call = PTHREAD_MUTEX_INITIALIZER,
        .lock = PTHREAD_MUTEX_INITIALIZER,
        .start = PTHREAD_COND_INITIALIZER,
        .done = PTHREAD_COND_INITIALIZER};

// The generation each worker was started at: it takes every job published after it (a worker started during a call
// must not mistake that call's job for an old one).
static int64_t start_generation[MAX_THREADS];

static void *worker(void *argument) {
    int64_t index = (int64_t)(intptr_t)argument;
    pthread_mutex_lock(&pool.lock);
    int64_t seen = start_generation[index];
    for (;;) {
        while (pool.generation == seen) pthread_cond_wait(&pool.start, &pool.lock);
        seen = pool.generation;
        if (index >= pool.active) continue;  // not part of this job
        const Job *job = pool.job;
        int scores = pool.scores;
        pthread_mutex_unlock(&pool.lock);
        run_items(job, scores, index);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

static void reset_after_fork(void) {  // the child has none of the parent's threads
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0, pool.active = 0, pool.pending = 0;
}

// Runs the job on `threads` threads (the calling one included); where a worker cannot be started, fewer threads take
// all the items (the job's thread count is set to the number that ran).
static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

static int run(Job *job, int scores) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, register_fork_handler);
    int64_t n = job->threads < 1 ? 1 : (job->threads > MAX_THREADS ? MAX_THREADS : job->threads);
    pthread_mutex_lock(&pool.call);
    while (pool.workers < n - 1) {  // workers 1 .. n - 1
        pthread_t id;
        start_generation[pool.workers + 1] = pool.generation;  // only run() changes it, under pool.call
        if (pthread_create(&id, NULL, worker, (void *)(intptr_t)(pool.workers + 1))) break;
        pthread_detach(id);
        pool.workers++;
    }
    if (n > pool.workers + 1) n = pool.workers + 1;
    job->threads = n;
    pthread_mutex_lock(&pool.lock);
    pool.job = job, pool.scores = scores, pool.active = n, pool.pending = n - 1;
    pool.generation++;
    pthread_cond_broadcast(&pool.start);
    pthread_mutex_unlock(&pool.lock);
    run_items(job, scores, 0);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    pthread_mutex_unlock(&pool.call);
    return 0;
}

// The fields both entry points share; returns 0, or -2 for a geometry the kernel does not take (the Python side checks
// it first).
static int code_job(Job *job, const int8_t *codes, const int64_t *code_strides, const void *scales,
                    const int64_t *scale_strides, int64_t scale_dtype, int64_t batch, int64_t heads, int64_t length,
                    int64_t dim, int64_t groups, int64_t int4, int64_t splits, int64_t threads) {
    if (dim % BLOCK || dim / BLOCK > MAX_BLOCKS || (dim / BLOCK) % groups || (int4 && dim % (2 * BLOCK))) return -2;
    memset(job, 0, sizeof *job);
    job->codes = codes;
    memcpy(job->code_strides, code_strides, sizeof job->code_strides);
    job->scales = scales;
    memcpy(job->scale_strides, scale_strides, sizeof job->scale_strides);
    job->scale_dtype = scale_dtype;
    job->batch = batch, job->heads = heads, job->length = length, job->dim = dim, job->groups = groups;
    job->int4 = int4, job->splits = splits, job->threads = threads;
    return 0;
}

int hc_scores(const int8_t *codes, const int64_t *code_strides, const void *scales, const int64_t *scale_strides,
              int64_t scale_dtype, int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t groups,
              int64_t int4, int64_t splits, int64_t threads, const int8_t *query, const float *query_weights,
              int64_t rows, int64_t out_rows, const float *row_constants, float *scores,
              const int64_t *score_strides) {
    Job job;
    if (code_job(&job, codes, code_strides, scales, scale_strides, scale_dtype, batch, heads, length, dim, groups, int4,
                 splits, threads))
        return -2;
    job.query = query, job.query_weights = query_weights, job.rows = rows, job.out_rows = out_rows;
    job.row_constants = row_constants, job.scores = scores;
    memcpy(job.score_strides, score_strides, sizeof job.score_strides);
    return run(&job, 1);
}

int hc_values(const int8_t *codes, const int64_t *code_strides, const void *scales, const int64_t *scale_strides,
              int64_t scale_dtype, int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t groups,
              int64_t int4, int64_t splits, int64_t threads, const float *probs, const int64_t *prob_strides,
              int64_t out_rows, float factor, float *partial) {
    Job job;
    if (code_job(&job, codes, code_strides, scales, scale_strides, scale_dtype, batch, heads, length, dim, groups, int4,
                 splits, threads))
        return -2;
    job.probs = probs, job.out_rows = out_rows, job.factor = factor, job.partial = partial;
    memcpy(job.prob_strides, prob_strides, sizeof job.prob_strides);
    return run(&job, 0);
}
