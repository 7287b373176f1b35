// The two history loops of attention on the codes (hybrid_cache/code_attention.py), built once per instruction set
// from this one source (hybrid_cache/code_kernel.py picks the set from the CPU's features, compiles this file with
// that set's flags and loads it with ctypes, after checking every shape, stride and dtype):
//
//   avx512  x86-64 AVX-512 F/BW/VL + VNNI (vpdpbusd), 16 float32 / 64 int8 lanes
//   avx2    x86-64 AVX2 + FMA + F16C (vpmaddubsw + vpmaddwd; vpdpbusd on 256 bits where the build has AVX-VNNI)
//   neon    aarch64 Advanced SIMD (vdotq_s32 where the build has the dot-product extension, vmull_s8 + vpadalq_s16
//           otherwise)
//
// Every set computes the same numbers: exact int32 dot products, float32 products and sums (only their order
// differs between sets and thread counts).
//
// hc_scores: for every history token t and query row r, row_constant[r] plus the sum over groups g of
//     key_scale[t, g] * query_weight[r, g] * (codes[t, g] . query[r, g])
// (query codes in [-127, 127], as hybrid_cache.code_attention rounds them). Rows r >= out_rows add into row
// r % out_rows (the second part of a two-part query).
// hc_values: for every query row j, sum over t of prob[j, t] * value_scale[t, g] * factor * codes[t, g], in float32,
// into one partial sum per (batch, head, split) that the caller adds up.
//
// Codes: int8 [.., L, D] with channels contiguous, or int4 [.., L, D / 2] (channel j in the low nibble of byte j,
// channel j + D / 2 in the high nibble), read as 16 x the nibble. D and the group size are multiples of 64
// (int4: D a multiple of 128), so that every 64-channel block lies in one group and in one half of the bytes.
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HC_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HC_AVX2 1
#include <immintrin.h>
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define HC_NEON 1
#include <arm_neon.h>
#else
#error "code_attention.c needs AVX-512 VNNI, AVX2 + FMA + F16C (x86-64) or NEON (aarch64): see code_kernel.py"
#endif

#define BLOCK 64
#define MAX_BLOCKS 16
#define MAX_THREADS 256

enum { SCALE_F32 = 0, SCALE_BF16 = 1, SCALE_F16 = 2 };

// The instruction set this build uses (the Python side checks it against the one it asked for).
const char *hc_isa(void) {
#if defined(HC_AVX512)
    return "avx512";
#elif defined(HC_AVX2) && defined(__AVXVNNI__)
    return "avx2+avx-vnni";
#elif defined(HC_AVX2)
    return "avx2";
#elif defined(__ARM_FEATURE_DOTPROD)
    return "neon+dotprod";
#else
    return "neon";
#endif
}

static inline float half_to_float(uint16_t half) {
#if defined(HC_NEON)
    __fp16 value;
    memcpy(&value, &half, sizeof value);
    return (float)value;
#else
    return _cvtsh_ss(half);
#endif
}

static inline float load_scale(const void *base, int64_t index, int64_t dtype) {
    if (dtype == SCALE_F32) return ((const float *)base)[index];
    uint16_t half = ((const uint16_t *)base)[index];
    if (dtype == SCALE_F16) return half_to_float(half);
    uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

// Tokens per tile of the value sum: each tile's codes are read from memory once (block by block from the caches).
#define VALUE_TILE 128

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

// The value sum's weights of tokens tile .. end - 1 for rows j0 .. j0 + rows - 1 (at most 4) and one group (whose
// scale index for token 0 is `scale_index`): prob * scale * factor, as weights[token - tile][row - j0].
static inline void tile_weights(const Job *a, const float *probs, int64_t scale_index, int64_t tile, int64_t end,
                                int64_t j0, int64_t rows, float *weights) {
    for (int64_t t = tile; t < end; t++) {
        float scale = a->factor * load_scale(a->scales, scale_index + t * a->scale_strides[2], a->scale_dtype);
        for (int64_t j = 0; j < rows; j++)
            weights[(t - tile) * 4 + j] = probs[(j0 + j) * a->prob_strides[2] + t] * scale;
    }
}

#if defined(HC_AVX512)
// --- AVX-512 VNNI -------------------------------------------------------------------------------------------------
// Block k (channels 64k .. 64k + 63) of one token, as int8 (int4: 16 x the nibble).
static inline __m512i load_block(const int8_t *row, int64_t k, int64_t half, int64_t int4) {
    if (!int4) return _mm512_loadu_si512((const void *)(row + k * BLOCK));
    const __m512i high_nibbles = _mm512_set1_epi8((char)0xF0);
    int64_t byte = k * BLOCK;
    if (byte < half)
        return _mm512_and_si512(_mm512_slli_epi16(_mm512_loadu_si512((const void *)(row + byte)), 4), high_nibbles);
    return _mm512_and_si512(_mm512_loadu_si512((const void *)(row + byte - half)), high_nibbles);
}

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


#elif defined(HC_AVX2)
// --- AVX2 + FMA (+ AVX-VNNI) ------------------------------------------------------------------------------------
// 32 channels (half h of block k) of one token, as int8 (int4: 16 x the nibble).
static inline __m256i load_half(const int8_t *row, int64_t k, int64_t h, int64_t half, int64_t int4) {
    int64_t byte = k * BLOCK + 32 * h;
    if (!int4) return _mm256_loadu_si256((const __m256i *)(row + byte));
    const __m256i high_nibbles = _mm256_set1_epi8((char)0xF0);
    if (byte < half)
        return _mm256_and_si256(_mm256_slli_epi16(_mm256_loadu_si256((const __m256i *)(row + byte)), 4), high_nibbles);
    return _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(row + byte - half)), high_nibbles);
}

// acc + the 32 products codes * query, summed in fours into 8 int32 lanes, exactly: the codes' magnitudes (|-128| =
// 128 read unsigned) times the query with the codes' signs, so that vpmaddubsw's unsigned x signed pair sums stay
// within int16 (2 * 128 * 127 < 2^15; the query is in [-127, 127]).
static inline __m256i dot32(__m256i acc, __m256i magnitudes, __m256i codes, __m256i query) {
    __m256i signed_query = _mm256_sign_epi8(query, codes);
#if defined(__AVXVNNI__)
    return _mm256_dpbusd_avx_epi32(acc, magnitudes, signed_query);
#else
    __m256i pairs = _mm256_maddubs_epi16(magnitudes, signed_query);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// Lane i of the result: the sum of the 8 lanes of v[i].
static inline __m256i sum_lanes8(const __m256i v[8]) {
    __m256i s01 = _mm256_hadd_epi32(v[0], v[1]), s23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i s45 = _mm256_hadd_epi32(v[4], v[5]), s67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i s0123 = _mm256_hadd_epi32(s01, s23), s4567 = _mm256_hadd_epi32(s45, s67);  // per 128-bit half
    return _mm256_add_epi32(_mm256_permute2x128_si256(s0123, s4567, 0x20),
                            _mm256_permute2x128_si256(s0123, s4567, 0x31));
}

// Scores of tokens t0 .. t1 - 1 of one (batch, head). The (row, group) dot products are formed 8 at a time (chunk c
// holds pairs 8c .. 8c + 7, pair i = row i / G, group i % G), summed lane-wise by one tree, converted and weighted
// in one vector each; the groups of a row are then added up.
static inline __attribute__((always_inline)) void scores_body(const Job *a, int64_t bh, int64_t t0, int64_t t1,
                                                               const int64_t G, const int64_t R, const int64_t per_group) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    int64_t m = a->out_rows;
    int64_t blocks = G * per_group, D = blocks * BLOCK, half = D / 2;
    int64_t pairs = R * G, chunks = (pairs + 7) / 8;
    const int8_t *codes = a->codes + b * a->code_strides[0] + h * a->code_strides[1];
    int64_t scale_base = b * a->scale_strides[0] + h * a->scale_strides[1];
    const int8_t *query = a->query + bh * R * D;
    const float *weights = a->query_weights + bh * R * G;
    const float *constants = a->row_constants + bh * m;
    float *out = a->scores + b * a->score_strides[0] + h * a->score_strides[1];
    float pair_weights[chunks * 8];
    int32_t group_of[chunks * 8];
    for (int64_t i = 0; i < chunks * 8; i++) {
        pair_weights[i] = i < pairs ? weights[i] : 0.0f;
        group_of[i] = (int32_t)(i < pairs ? i % G : 0);
    }
    __m256i signed_codes[2 * MAX_BLOCKS], magnitudes[2 * MAX_BLOCKS], dots[8];
    float token_scales[16] = {0}, products[8], row_sums[R];
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *row = codes + t * a->code_strides[2];
        for (int64_t k = 0; k < blocks; k++)
            for (int64_t i = 0; i < 2; i++) {
                signed_codes[2 * k + i] = load_half(row, k, i, half, a->int4);
                magnitudes[2 * k + i] = _mm256_abs_epi8(signed_codes[2 * k + i]);
            }
        for (int64_t g = 0; g < G; g++)
            token_scales[g] = load_scale(a->scales, scale_base + t * a->scale_strides[2] + g, a->scale_dtype);
        __m256 scales_low = _mm256_loadu_ps(token_scales), scales_high = _mm256_loadu_ps(token_scales + 8);
        for (int64_t r = 0; r < R; r++) row_sums[r] = 0.0f;
        for (int64_t c = 0; c < chunks; c++) {
            for (int64_t l = 0; l < 8; l++) {
                int64_t i = c * 8 + l;
                __m256i dot = _mm256_setzero_si256();
                if (i < pairs) {
                    int64_t r = i / G, g = i % G;
                    for (int64_t v = 2 * g * per_group; v < 2 * (g + 1) * per_group; v++)
                        dot = dot32(dot, magnitudes[v], signed_codes[v],
                                    _mm256_loadu_si256((const __m256i *)(query + r * D + v * 32)));
                }
                dots[l] = dot;
            }
            __m256i exact = sum_lanes8(dots);
            __m256i group = _mm256_loadu_si256((const __m256i *)(group_of + c * 8));
            __m256 scale = _mm256_permutevar8x32_ps(scales_low, group);
            if (G > 8) {
                __m256 high = _mm256_permutevar8x32_ps(scales_high, group);
                __m256i upper = _mm256_cmpgt_epi32(group, _mm256_set1_epi32(7));
                scale = _mm256_blendv_ps(scale, high, _mm256_castsi256_ps(upper));
            }
            scale = _mm256_mul_ps(scale, _mm256_loadu_ps(pair_weights + c * 8));
            _mm256_storeu_ps(products, _mm256_mul_ps(_mm256_cvtepi32_ps(exact), scale));
            for (int64_t l = 0; l < 8 && c * 8 + l < pairs; l++) row_sums[(c * 8 + l) / G] += products[l];
        }
        for (int64_t r = 0; r < R; r++) {
            if (r < m) out[r * a->score_strides[2] + t] = row_sums[r] + constants[r];
            else out[(r % m) * a->score_strides[2] + t] += row_sums[r];
        }
    }
}

// Channels c .. c + 15 of one token as float32 (int4: 16 x the nibble).
static inline void strip_to_float(const int8_t *row, int64_t c, int64_t half, int64_t int4, __m256 f[2]) {
    if (!int4) {  // sign-extending loads straight from memory
        f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c))));
        f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + c + 8))));
        return;
    }
    const __m128i high_nibbles = _mm_set1_epi8((char)0xF0);
    __m128i x = c < half ? _mm_and_si128(_mm_slli_epi16(_mm_loadu_si128((const __m128i *)(row + c)), 4), high_nibbles)
                         : _mm_and_si128(_mm_loadu_si128((const __m128i *)(row + c - half)), high_nibbles);
    f[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
    f[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(x, 8)));
}

// Channels c .. c + 15 of rows 0 .. rows - 1 (at most 4) of `out` ([row][D]): + sum over tokens tile .. end - 1 of
// weights[token - tile][row] x the token's codes, accumulated in registers (one conversion per token for all rows).
static inline __attribute__((always_inline)) void values_strip(const Job *a, const int8_t *codes, int64_t half,
                                                                int64_t c, int64_t tile, int64_t end,
                                                                const float *weights, float *out, int64_t D,
                                                                int64_t rows) {
    __m256 acc[4][2];
    for (int64_t j = 0; j < 4; j++)
        for (int i = 0; i < 2; i++)
            acc[j][i] = j < rows ? _mm256_loadu_ps(out + j * D + c + 8 * i) : _mm256_setzero_ps();
    for (int64_t t = tile; t < end; t++) {
        __m256 f[2];
        strip_to_float(codes + t * a->code_strides[2], c, half, a->int4, f);
        const float *w = weights + (t - tile) * 4;
        for (int64_t j = 0; j < rows; j++) {
            __m256 weight = _mm256_broadcast_ss(w + j);
            acc[j][0] = _mm256_fmadd_ps(f[0], weight, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(f[1], weight, acc[j][1]);
        }
    }
    for (int64_t j = 0; j < rows; j++)
        for (int i = 0; i < 2; i++) _mm256_storeu_ps(out + j * D + c + 8 * i, acc[j][i]);
}

#else
// --- NEON (+ dot product) ---------------------------------------------------------------------------------------
// 16 channels (quarter i of block k) of one token, as int8 (int4: 16 x the nibble).
static inline int8x16_t load_quarter(const int8_t *row, int64_t k, int64_t i, int64_t half, int64_t int4) {
    int64_t byte = k * BLOCK + 16 * i;
    if (!int4) return vld1q_s8(row + byte);
    if (byte < half) return vshlq_n_s8(vld1q_s8(row + byte), 4);
    return vandq_s8(vld1q_s8(row + byte - half), vdupq_n_s8((int8_t)0xF0));
}

// acc + the 16 products a * b, summed in fours into 4 int32 lanes, exactly (|a * b| <= 128 * 128 fits int16).
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__ARM_FEATURE_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_high_s8(a, b));
#endif
}

// Scores of tokens t0 .. t1 - 1 of one (batch, head): each (row, group) dot product in one vector, summed across.
static inline __attribute__((always_inline)) void scores_body(const Job *a, int64_t bh, int64_t t0, int64_t t1,
                                                               const int64_t G, const int64_t R, const int64_t per_group) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    int64_t m = a->out_rows;
    int64_t blocks = G * per_group, D = blocks * BLOCK, half = D / 2;
    const int8_t *codes = a->codes + b * a->code_strides[0] + h * a->code_strides[1];
    int64_t scale_base = b * a->scale_strides[0] + h * a->scale_strides[1];
    const int8_t *query = a->query + bh * R * D;
    const float *weights = a->query_weights + bh * R * G;
    const float *constants = a->row_constants + bh * m;
    float *out = a->scores + b * a->score_strides[0] + h * a->score_strides[1];
    int8x16_t token_codes[4 * MAX_BLOCKS];
    float token_scales[16];
    for (int64_t t = t0; t < t1; t++) {
        const int8_t *row = codes + t * a->code_strides[2];
        for (int64_t k = 0; k < blocks; k++)
            for (int64_t i = 0; i < 4; i++) token_codes[4 * k + i] = load_quarter(row, k, i, half, a->int4);
        for (int64_t g = 0; g < G; g++)
            token_scales[g] = load_scale(a->scales, scale_base + t * a->scale_strides[2] + g, a->scale_dtype);
        for (int64_t r = 0; r < R; r++) {
            float sum = 0.0f;
            for (int64_t g = 0; g < G; g++) {
                int32x4_t dot = vdupq_n_s32(0);
                for (int64_t v = 4 * g * per_group; v < 4 * (g + 1) * per_group; v++)
                    dot = dot16(dot, token_codes[v], vld1q_s8(query + r * D + v * 16));
                sum += (float)vaddvq_s32(dot) * (token_scales[g] * weights[r * G + g]);
            }
            if (r < m) out[r * a->score_strides[2] + t] = sum + constants[r];
            else out[(r % m) * a->score_strides[2] + t] += sum;
        }
    }
}

// As in the AVX2 path: channels c .. c + 15 of rows 0 .. rows - 1 (at most 4), 16 of the 32 registers accumulating.
static inline __attribute__((always_inline)) void values_strip(const Job *a, const int8_t *codes, int64_t half,
                                                                int64_t c, int64_t tile, int64_t end,
                                                                const float *weights, float *out, int64_t D,
                                                                int64_t rows) {
    float32x4_t acc[4][4];
    for (int64_t j = 0; j < 4; j++)
        for (int i = 0; i < 4; i++) acc[j][i] = j < rows ? vld1q_f32(out + j * D + c + 4 * i) : vdupq_n_f32(0.0f);
    for (int64_t t = tile; t < end; t++) {
        int8x16_t x = load_quarter(codes + t * a->code_strides[2], c / BLOCK, (c % BLOCK) / 16, half, a->int4);
        int16x8_t low = vmovl_s8(vget_low_s8(x)), high = vmovl_high_s8(x);
        float32x4_t f[4] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(low))), vcvtq_f32_s32(vmovl_high_s16(low)),
                            vcvtq_f32_s32(vmovl_s16(vget_low_s16(high))), vcvtq_f32_s32(vmovl_high_s16(high))};
        const float *w = weights + (t - tile) * 4;
        for (int64_t j = 0; j < rows; j++)
            for (int i = 0; i < 4; i++) acc[j][i] = vfmaq_n_f32(acc[j][i], f[i], w[j]);
    }
    for (int64_t j = 0; j < rows; j++)
        for (int i = 0; i < 4; i++) vst1q_f32(out + j * D + c + 4 * i, acc[j][i]);
}

#endif

#if !defined(HC_AVX512)
// The value sum of tokens t0 .. t1 - 1 of one (batch, head) (AVX2, NEON): per tile of tokens, group of 4 rows and
// block of 64 channels, the tokens' weights prob * scale * factor once, then 4 strips of 16 channels.
static inline __attribute__((always_inline)) void values_body(const Job *a, int64_t bh, int64_t split, int64_t t0,
                                                               int64_t t1, const int64_t m, const int64_t blocks) {
    int64_t b = bh / a->heads, h = bh % a->heads;
    int64_t G = a->groups, per_group = blocks / G, D = blocks * BLOCK, half = D / 2;
    const int8_t *codes = a->codes + b * a->code_strides[0] + h * a->code_strides[1];
    int64_t scale_base = b * a->scale_strides[0] + h * a->scale_strides[1];
    const float *probs = a->probs + b * a->prob_strides[0] + h * a->prob_strides[1];
    float *out = a->partial + (bh * a->splits + split) * m * D;
    float token_weights[VALUE_TILE * 4];  // [token][row] of rows j0 .. j0 + 3
    memset(out, 0, sizeof(float) * m * D);
    for (int64_t tile = t0; tile < t1; tile += VALUE_TILE) {
        int64_t end = tile + VALUE_TILE < t1 ? tile + VALUE_TILE : t1;
        for (int64_t j0 = 0; j0 < m; j0 += 4) {
            int64_t rows = m - j0 < 4 ? m - j0 : 4;
            for (int64_t k = 0; k < blocks; k++) {
                if (k % per_group == 0)
                    tile_weights(a, probs, scale_base + k / per_group, tile, end, j0, rows, token_weights);
                for (int64_t c = k * BLOCK; c < (k + 1) * BLOCK; c += 16)
                    values_strip(a, codes, half, c, tile, end, token_weights, out + j0 * D, D, rows);
            }
        }
    }
}
#endif

// The unrolled geometries (every set): Gemma 3's / Gemma 4's 4 or 8 rows, 4 or 8 groups of 64 (heads of 256 / 512).
static void scores_item(const Job *a, int64_t bh, int64_t t0, int64_t t1) {
    int64_t G = a->groups, R = a->rows, per_group = a->dim / BLOCK / a->groups;
    if (per_group == 1 && G == 4 && R == 4) scores_body(a, bh, t0, t1, 4, 4, 1);
    else if (per_group == 1 && G == 4 && R == 8) scores_body(a, bh, t0, t1, 4, 8, 1);
    else if (per_group == 1 && G == 8 && R == 4) scores_body(a, bh, t0, t1, 8, 4, 1);
    else if (per_group == 1 && G == 8 && R == 8) scores_body(a, bh, t0, t1, 8, 8, 1);
    else scores_body(a, bh, t0, t1, G, R, per_group);
}


static void values_item(const Job *a, int64_t bh, int64_t split, int64_t t0, int64_t t1) {
    int64_t m = a->out_rows, blocks = a->dim / BLOCK;
    if (m == 4 && blocks == 4) values_body(a, bh, split, t0, t1, 4, 4);
    else if (m == 8 && blocks == 4) values_body(a, bh, split, t0, t1, 8, 4);
    else if (m == 4 && blocks == 8) values_body(a, bh, split, t0, t1, 4, 8);
    else if (m == 8 && blocks == 8) values_body(a, bh, split, t0, t1, 8, 8);
    else values_body(a, bh, split, t0, t1, m, blocks);
}

// Work items are (batch x head, split) pairs, each a contiguous range of tokens; thread i of n takes i, i + n, ...
static void run_items(const Job *a, int scores, int64_t thread, int64_t count) {
    int64_t chunk = (a->length + a->splits - 1) / a->splits;
    for (int64_t item = thread; item < a->batch * a->heads * a->splits; item += count) {
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
        run_items(job, scores, index, job->threads);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_signal(&pool.done);
    }
    return NULL;
}

// Set in a child forked after the library was loaded: GNU OpenMP cannot start a team there if the parent ran one
// (torch's own parallel operations hang in such a child too), so the child uses the pool below.
static volatile int forked_child = 0;

static void reset_after_fork(void) {  // the child has none of the parent's threads
    pthread_mutex_init(&pool.call, NULL);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.start, NULL);
    pthread_cond_init(&pool.done, NULL);
    pool.workers = 0, pool.active = 0, pool.pending = 0;
    forked_child = 1;
}

__attribute__((constructor)) static void register_fork_handler(void) { pthread_atfork(NULL, NULL, reset_after_fork); }

// How this build runs a call's threads: "openmp" (the team of the OpenMP runtime the library was linked to, torch's
// own, so that torch's workers, which spin for a while after each parallel operation, take the kernel's items instead
// of competing with a second set of threads for the cores), or "pthreads" (the pool above).
const char *hc_threads(void) {
#if defined(_OPENMP)
    return "openmp";
#else
    return "pthreads";
#endif
}

// Runs the job's items on the pool's threads: `threads` of them, the calling one included; where a worker cannot be
// started, fewer threads take all the items (the job's thread count is set to the number that ran).
static void run_on_pool(Job *job, int scores, int64_t n) {
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
    run_items(job, scores, 0, n);
    pthread_mutex_lock(&pool.lock);
    while (pool.pending) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
}

// Runs the job on `threads` threads (one call at a time): an OpenMP team where the build has OpenMP (each thread
// takes its share of the items from the team's actual size, which the runtime may make smaller), else the pool.
static int run(Job *job, int scores) {
    int64_t n = job->threads < 1 ? 1 : (job->threads > MAX_THREADS ? MAX_THREADS : job->threads);
    pthread_mutex_lock(&pool.call);
#if defined(_OPENMP)
    if (!forked_child) {
        job->threads = n;
#pragma omp parallel num_threads((int)n) if (n > 1)
        run_items(job, scores, omp_get_thread_num(), omp_get_num_threads());
    } else {
        run_on_pool(job, scores, n);
    }
#else
    run_on_pool(job, scores, n);
#endif
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
