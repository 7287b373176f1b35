// Random cases of the native kernel (hybrid_cache/csrc/code_attention.c, compiled with it for one instruction set)
// against a reference in plain C (double precision, no vector code), for scripts/kernel_cross_check.sh: there it runs
// natively (x86-64) or under qemu-user (aarch64).
//
// Each case draws a geometry the kernel takes (batch, heads, head size 64-512 and groups of 64-512 channels, int8 or
// int4 codes in a strided storage larger than the history, float32 / bfloat16 / float16 scales, 1-16 output rows of
// one or two query parts, 1-4 threads and 1-3 token ranges per head), calls hc_scores and hc_values and compares:
//   - scores with float32 summation order as the only difference (tolerance: 2e-6 x the sum of the terms'
//     magnitudes), and, in the cases drawn as exact (all scales and weights 1, no constants), bit-equal to the
//     integer dot products (|dot| < 2^24, so float32 holds them exactly);
//   - value sums over probabilities with masked (zero) tokens and fully masked rows (which must give exact zeros),
//     with tolerance (1e-6 x tokens + 1e-5) x the sum of the terms' magnitudes.
// Prints one line per failing case and `<name>: N/N cases match`; exits 0 only when every case matches.
//
//     cc <the kernel's flags> tests/kernel/cross_check.c hybrid_cache/csrc/code_attention.c -lm -o check
//     ./check <name> [cases] [first seed]
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *hc_isa(void);
const char *hc_threads(void);
int hc_scores(const int8_t *codes, const int64_t *code_strides, const void *scales, const int64_t *scale_strides,
              int64_t scale_dtype, int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t groups,
              int64_t int4, int64_t splits, int64_t threads, const int8_t *query, const float *query_weights,
              int64_t rows, int64_t out_rows, const float *row_constants, float *scores, const int64_t *score_strides);
int hc_values(const int8_t *codes, const int64_t *code_strides, const void *scales, const int64_t *scale_strides,
              int64_t scale_dtype, int64_t batch, int64_t heads, int64_t length, int64_t dim, int64_t groups,
              int64_t int4, int64_t splits, int64_t threads, const float *probs, const int64_t *prob_strides,
              int64_t out_rows, float factor, float *partial);

static uint64_t state;
static uint64_t next(void) {  // xorshift64*
    state ^= state >> 12, state ^= state << 25, state ^= state >> 27;
    return state * 2685821657736338717ull;
}
static int64_t pick(int64_t low, int64_t high) { return low + (int64_t)(next() % (uint64_t)(high - low + 1)); }
static double uniform(void) { return (double)(next() >> 11) / 9007199254740992.0; }

// Scale storage: the kernel's three dtypes, decoded here without any vector or compiler half-precision support.
static float bf16_value(uint16_t bits) {
    uint32_t wide = (uint32_t)bits << 16;
    float value;
    memcpy(&value, &wide, sizeof value);
    return value;
}
static float f16_value(uint16_t bits) {
    int sign = bits >> 15, exponent = (bits >> 10) & 31, mantissa = bits & 1023;
    double value = exponent == 0 ? ldexp(mantissa, -24) : ldexp(1024 + mantissa, exponent - 25);
    return (float)(sign ? -value : value);
}
static uint16_t f16_bits(float x) {  // x in [2^-14, 2): normal, rounded down (any half is a valid scale)
    int exponent;
    double fraction = frexp(x, &exponent);  // x = fraction * 2^exponent, fraction in [0.5, 1)
    return (uint16_t)(((exponent - 1 + 15) << 10) | ((int)(fraction * 2048) - 1024));
}
static float scale_value(const void *scales, int64_t index, int dtype) {
    if (dtype == 0) return ((const float *)scales)[index];
    uint16_t bits = ((const uint16_t *)scales)[index];
    return dtype == 1 ? bf16_value(bits) : f16_value(bits);
}

// Channel c of a token's codes as the kernel reads it: int8 as is, int4 as 16 x the signed nibble.
static int code_of(const int8_t *row, int64_t c, int64_t dim, int int4) {
    if (!int4) return row[c];
    uint8_t byte = (uint8_t)row[c % (dim / 2)];
    int nibble = c < dim / 2 ? (byte & 15) : (byte >> 4);
    return 16 * (nibble >= 8 ? nibble - 16 : nibble);
}

static int run_case(uint64_t seed, int verbose) {
    state = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < 4; i++) next();
    int int4 = (int)pick(0, 1), dtype = (int)pick(0, 2), exact = pick(0, 3) == 0;
    int64_t batch = pick(1, 3), heads = pick(1, 3), dim = int4 ? 128 * pick(1, 4) : 64 * pick(1, pick(0, 3) ? 8 : 16);
    int64_t blocks = dim / 64, groups;
    do groups = pick(1, blocks); while (blocks % groups);
    int64_t length = pick(0, 4) == 0 ? pick(1, 40) : pick(41, pick(0, 3) ? 600 : 1500), capacity = length + pick(0, 70);
    int64_t packed = int4 ? dim / 2 : dim, token_stride = packed + 64 * pick(0, 1);
    int64_t out_rows = pick(0, 3) == 0 ? 16 : pick(1, 9), parts = pick(1, 2), rows = out_rows * parts;
    int64_t threads = pick(1, 4), splits = pick(1, 3);
    if (exact) dtype = (int)pick(0, 1), parts = 1, rows = out_rows;
    int64_t code_strides[3] = {heads * capacity * token_stride, capacity * token_stride, token_stride};
    int8_t *codes = malloc((size_t)(batch * code_strides[0]));
    int extreme = (int)pick(0, 5);  // 0: every code -128, 1: every code 127 (with extreme queries), else random
    for (int64_t i = 0; i < batch * code_strides[0]; i++)
        codes[i] = extreme == 0 ? (int8_t)-128 : extreme == 1 ? (int8_t)127 : (int8_t)pick(-128, 127);
    // Scales [B, H, capacity + 3, G]: the token stride differs from G when the storage pads it.
    int64_t scale_token = groups + (pick(0, 1) ? 3 : 0);
    int64_t scale_strides[3] = {heads * capacity * scale_token, capacity * scale_token, scale_token};
    size_t scale_count = (size_t)(batch * scale_strides[0]);
    void *scales = malloc(scale_count * 4);
    for (size_t i = 0; i < scale_count; i++) {
        float x = exact ? 1.0f : (float)(0.001 + 0.05 * uniform());
        if (dtype == 0) ((float *)scales)[i] = x;
        else if (dtype == 1) {
            uint32_t bits;
            memcpy(&bits, &x, sizeof bits);
            ((uint16_t *)scales)[i] = (uint16_t)(bits >> 16);
        } else ((uint16_t *)scales)[i] = f16_bits(x);
    }
    int64_t query_count = batch * heads * rows * dim;
    int8_t *query = malloc((size_t)query_count);
    for (int64_t i = 0; i < query_count; i++)
        query[i] = extreme == 0 ? (int8_t)-127 : extreme == 1 ? (int8_t)127 : (int8_t)pick(-127, 127);
    float *weights = malloc(sizeof(float) * (size_t)(batch * heads * rows * groups));
    for (int64_t i = 0; i < batch * heads * rows * groups; i++) weights[i] = exact ? 1.0f : (float)(uniform() - 0.5);
    float *constants = malloc(sizeof(float) * (size_t)(batch * heads * out_rows));
    for (int64_t i = 0; i < batch * heads * out_rows; i++) constants[i] = exact ? 0.0f : (float)(4 * uniform() - 2);
    // Scores and probabilities [B, H, out_rows, length + pad]: the history's columns of a larger matrix.
    int64_t columns = length + pick(0, 5);
    int64_t score_strides[3] = {heads * out_rows * columns, out_rows * columns, columns};
    size_t score_count = (size_t)(batch * score_strides[0]);
    float *scores = malloc(sizeof(float) * (score_count + 1)), *probs = malloc(sizeof(float) * (score_count + 1));
    for (size_t i = 0; i < score_count; i++) {
        scores[i] = NAN;
        probs[i] = uniform() < 0.2 ? 0.0f : (float)uniform();  // masked tokens: probability 0
    }
    int64_t masked_row = pick(0, out_rows);  // == out_rows: none; otherwise a fully masked row (all zeros)
    for (int64_t bh = 0; bh < batch * heads; bh++)
        for (int64_t t = 0; t < columns && masked_row < out_rows; t++)
            probs[(bh * out_rows + masked_row) * columns + t] = 0;
    float factor = int4 ? 1.0f / 16 : 1.0f;
    float *partial = malloc(sizeof(float) * (size_t)(batch * heads * splits * out_rows * dim + 1));
    int status = hc_scores(codes, code_strides, scales, scale_strides, dtype, batch, heads, length, dim, groups, int4,
                           splits, threads, query, weights, rows, out_rows, constants, scores, score_strides);
    status |= hc_values(codes, code_strides, scales, scale_strides, dtype, batch, heads, length, dim, groups, int4,
                        splits, threads, probs, score_strides, out_rows, factor, partial);
    int64_t bad = 0;
    double worst = 0;
    for (int64_t b = 0; b < batch && !status; b++)
        for (int64_t h = 0; h < heads; h++) {
            int64_t bh = b * heads + h;
            const int8_t *history = codes + b * code_strides[0] + h * code_strides[1];
            int64_t scale_base = b * scale_strides[0] + h * scale_strides[1];
            for (int64_t j = 0; j < out_rows; j++) {
                for (int64_t t = 0; t < length; t++) {  // scores
                    double sum = constants[bh * out_rows + j], magnitude = fabs(sum);
                    for (int64_t r = j; r < rows; r += out_rows)
                        for (int64_t g = 0; g < groups; g++) {
                            int64_t dot = 0, size = dim / groups;
                            for (int64_t c = g * size; c < (g + 1) * size; c++)
                                dot += (int64_t)code_of(history + t * token_stride, c, dim, int4) *
                                       query[(bh * rows + r) * dim + c];
                            double term = (double)scale_value(scales, scale_base + t * scale_token + g, dtype) *
                                          weights[(bh * rows + r) * groups + g] * (double)dot;
                            sum += term, magnitude += fabs(term);
                        }
                    double got = scores[b * score_strides[0] + h * score_strides[1] + j * columns + t];
                    double error = fabs(got - sum), allowed = exact ? 0.0 : 2e-6 * magnitude + 1e-30;
                    if (!(error <= allowed)) {
                        if (verbose && bad < 3)
                            fprintf(stderr, "  score b%ld h%ld row %ld token %ld: %.9g, reference %.9g\n", (long)b,
                                    (long)h, (long)j, (long)t, got, sum);
                        bad++;
                    }
                    if (magnitude > 0 && error / magnitude > worst) worst = error / magnitude;
                }
                for (int64_t c = 0; c < dim; c++) {  // value sums
                    double sum = 0, magnitude = 0, got = 0;
                    for (int64_t t = 0; t < length; t++) {
                        double term = (double)probs[b * score_strides[0] + h * score_strides[1] + j * columns + t] *
                                      scale_value(scales, scale_base + t * scale_token + c / (dim / groups), dtype) *
                                      factor * code_of(history + t * token_stride, c, dim, int4);
                        sum += term, magnitude += fabs(term);
                    }
                    for (int64_t s = 0; s < splits; s++) got += partial[((bh * splits + s) * out_rows + j) * dim + c];
                    if (!length) got = 0;  // no item runs: the caller returns zeros itself
                    double allowed = (1e-6 * (double)length + 1e-5) * magnitude;
                    if (!(fabs(got - sum) <= allowed) || (j == masked_row && got != 0.0)) {
                        if (verbose && bad < 3)
                            fprintf(stderr, "  value b%ld h%ld row %ld channel %ld: %.9g, reference %.9g\n", (long)b,
                                    (long)h, (long)j, (long)c, got, sum);
                        bad++;
                    }
                }
            }
        }
    int ok = !status && !bad;
    if (!ok || verbose > 1)
        fprintf(stderr,
                "case %llu: %s, %s scales, batch %ld, heads %ld, dim %ld, groups %ld, tokens %ld, rows %ld x %ld "
                "parts, threads %ld, splits %ld%s%s: status %d, %ld mismatches (worst relative error %.2g)\n",
                (unsigned long long)seed, int4 ? "int4" : "int8", dtype == 0 ? "f32" : dtype == 1 ? "bf16" : "f16",
                (long)batch, (long)heads, (long)dim, (long)groups, (long)length, (long)out_rows, (long)parts,
                (long)threads, (long)splits, exact ? ", exact" : "", extreme < 2 ? ", extreme codes" : "", status,
                (long)bad, worst);
    free(codes), free(scales), free(query), free(weights), free(constants), free(scores), free(probs), free(partial);
    return ok;
}

int main(int argc, char **argv) {
    const char *name = argc > 1 ? argv[1] : hc_isa();
    int cases = argc > 2 ? atoi(argv[2]) : 40;
    uint64_t first = argc > 3 ? strtoull(argv[3], NULL, 10) : 1;
    int verbose = getenv("CROSS_CHECK_VERBOSE") ? atoi(getenv("CROSS_CHECK_VERBOSE")) : 1;
    int matched = 0;
    for (int i = 0; i < cases; i++) matched += run_case(first + (uint64_t)i, verbose);
    printf("%s (%s build on %s): %d/%d cases match\n", name, hc_isa(), hc_threads(), matched, cases);
    return matched == cases && cases > 0 ? 0 : 1;
}
