/* XXH3_64bits' long loop and the stream built on it, compiled once per instruction set
 * (xxh3_scalar.c, xxh3_sse2.c, xxh3_avx2.c, xxh3_avx512.c): the including file defines XXH3_KERNEL
 * (the suffix of the names) and, for a vector kernel, XXH3_KERNEL_SSE2, XXH3_KERNEL_AVX2 or
 * XXH3_KERNEL_AVX512.
 *
 * A stripe is 64 bytes: lane i of eight takes its 8 input bytes d, xors them with its 8 secret
 * bytes into k, adds d to the neighbouring lane (i ^ 1) and the product of k's two 32-bit halves to
 * its own. Stripe s of a block takes the secret from byte 8s; after 16 stripes each lane is
 * scrambled (shifted into itself, xor'ed with the secret's last 64 bytes, times PRIME32_1).
 */
#include "xxh3.h"
#include "xxh3_parts.h"

#if !defined(XXH3_KERNEL)
#error "define XXH3_KERNEL before including xxh3_kernel.h"
#endif

#define XXH3_PASTE(a, b) a##_##b
#define XXH3_NAME(a, b) XXH3_PASTE(a, b)

/* Each kernel gives the eight lanes as a type held in registers (lanes_t) and four steps on it:
 * load, store, one stripe, scramble. What follows them is written once. */
#ifdef XXH3_KERNEL_AVX512
#include <immintrin.h>

typedef struct { __m512i a; } lanes_t;   /* all eight lanes in one register: a stripe is one load */

/* The stream copies (lanes_stripe_copy) with 64-byte streamed stores: `out` 64-byte aligned. */
#define XXH3_COPY_ALIGN 64

static inline lanes_t lanes_load(const uint64_t acc[8]) {
    return (lanes_t){_mm512_loadu_si512(acc)};
}

static inline void lanes_store(uint64_t acc[8], lanes_t l) {
    _mm512_storeu_si512(acc, l.a);
}

/* The AVX2 kernel's stripe, the eight lanes at once. */
static inline __m512i lanes_fold512(__m512i a, __m512i d, const uint8_t *key) {
    __m512i k = _mm512_xor_si512(d, _mm512_loadu_si512(key));
    __m512i p = _mm512_mul_epu32(k, _mm512_srli_epi64(k, 32));
    return _mm512_add_epi64(a, _mm512_add_epi64(p, _mm512_shuffle_epi32(d, (_MM_PERM_ENUM)_MM_SHUFFLE(1, 0, 3, 2))));
}

static inline void lanes_stripe(lanes_t *l, const uint8_t *in, const uint8_t *key) {
    l->a = lanes_fold512(l->a, _mm512_loadu_si512(in), key);
    __asm__("" : "+v"(l->a));   /* one stripe's sum at a time, as in AVX2's */
}

/* lanes_stripe of a stripe also written to `out` (64-byte aligned) in one streamed store, a whole
 * cache line, from the register it was read into. */
static inline void lanes_stripe_copy(lanes_t *l, const uint8_t *in, uint8_t *out, const uint8_t *key) {
    __m512i d = _mm512_loadu_si512(in);
    _mm512_stream_si512((__m512i *)out, d);
    l->a = lanes_fold512(l->a, d, key);
    __asm__("" : "+v"(l->a));
}

static inline void lanes_scramble(lanes_t *l) {
    const __m512i prime = _mm512_set1_epi64(XXH3_PRIME32_1);
    __m512i key = _mm512_loadu_si512(xxh3_secret + XXH3_SCRAMBLE_KEY);
    __m512i a = _mm512_xor_si512(_mm512_xor_si512(l->a, _mm512_srli_epi64(l->a, 47)), key);
    __m512i lo = _mm512_mul_epu32(a, prime);
    __m512i hi = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), prime);
    l->a = _mm512_add_epi64(lo, _mm512_slli_epi64(hi, 32));
}

/* fold_to with `out` a whole number of 4-byte words past a cache line (numpy's own arrays are 16 past):
 * each streamed store is still a whole line, put together from the stripe before and this one (one
 * permute of the two registers they were read into, so what is written is what is folded), and the
 * partial lines at the two ends are written with masked stores, which leave the bytes around `out`'s
 * count stripes as they were. Gets of 1 MiB pages into np.zeros, through the SDK, against the bounce buffer
 * they took before: 4.41 / 4.76 -> 5.49 / 5.55 GB/s (into a page-aligned buffer 6.2-6.4). */
#define XXH3_COPY_SHIFTS 4   /* fold_to_shifted takes `out` on any 4-byte boundary (COPY_AND_HASH_ALIGN of AVX-512) */
static inline void fold_to_shifted(uint64_t acc[8], uint32_t *stripes, const uint8_t *in, uint8_t *out,
                                   size_t count) {
    if (!count)
        return;   /* no stripe: the masked store at the end would write before `out` */
    const unsigned words = ((uintptr_t)out & 63) / 4;   /* of the first line, not ours: 1 to 15 */
    const __m512i from = _mm512_add_epi32(_mm512_set1_epi32(16 - (int)words),
                                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    uint8_t *line = out - 4 * words;
    lanes_t l = lanes_load(acc);
    size_t s = *stripes;
    __m512i before = _mm512_setzero_si512();
    for (size_t k = 0; k < count; k++, in += 64, line += 64) {
        __m512i d = _mm512_loadu_si512(in);
        __m512i joined = _mm512_permutex2var_epi32(before, from, d);   /* word i: (before ++ d)[16 - words + i] */
        if (k)
            _mm512_stream_si512((__m512i *)line, joined);
        else
            _mm512_mask_storeu_epi32(line, (__mmask16)(0xFFFFu << words), joined);
        l.a = lanes_fold512(l.a, d, xxh3_secret + 8 * s);
        __asm__("" : "+v"(l.a));
        if (++s == XXH3_BLOCK_STRIPES) {
            lanes_scramble(&l);
            s = 0;
        }
        before = d;
    }
    _mm512_mask_storeu_epi32(line, (__mmask16)((1u << words) - 1), _mm512_permutex2var_epi32(before, from, before));
    *stripes = (uint32_t)s;
    lanes_store(acc, l);
}

#elif defined(XXH3_KERNEL_AVX2)
#include <immintrin.h>

typedef struct { __m256i a[2]; } lanes_t;   /* lanes 0-3, 4-7 */

#define XXH3_COPY_ALIGN 32   /* lanes_stripe_copy's 32-byte streamed stores: `out` 32-byte aligned */

static inline lanes_t lanes_load(const uint64_t acc[8]) {
    return (lanes_t){{_mm256_loadu_si256((const __m256i *)acc), _mm256_loadu_si256((const __m256i *)(acc + 4))}};
}

static inline void lanes_store(uint64_t acc[8], lanes_t l) {
    _mm256_storeu_si256((__m256i *)acc, l.a[0]);
    _mm256_storeu_si256((__m256i *)(acc + 4), l.a[1]);
}

static inline void lanes_stripe(lanes_t *l, const uint8_t *in, const uint8_t *key) {
    for (int j = 0; j < 2; j++) {
        __m256i d = _mm256_loadu_si256((const __m256i *)(in + 32 * j));
        __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(key + 32 * j)));
        /* lo32(k) * hi32(k) per lane; d with the two 64-bit lanes of each 128 swapped (lane i ^ 1) */
        __m256i p = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
        l->a[j] = _mm256_add_epi64(l->a[j], _mm256_add_epi64(p, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    /* Each stripe's sum joins the lanes before the next stripe starts: left free, gcc regroups an
     * unrolled block's 32 additions into a tree whose terms outnumber the registers, and spills
     * (about a fifth slower). */
    __asm__("" : "+x"(l->a[0]), "+x"(l->a[1]));
}

/* lanes_stripe of a stripe also written to `out` (32-byte aligned), streamed from the registers it was
 * read into: what is folded is exactly what was written. */
static inline void lanes_stripe_copy(lanes_t *l, const uint8_t *in, uint8_t *out, const uint8_t *key) {
    for (int j = 0; j < 2; j++) {
        __m256i d = _mm256_loadu_si256((const __m256i *)(in + 32 * j));
        _mm256_stream_si256((__m256i *)(out + 32 * j), d);
        __m256i k = _mm256_xor_si256(d, _mm256_loadu_si256((const __m256i *)(key + 32 * j)));
        __m256i p = _mm256_mul_epu32(k, _mm256_srli_epi64(k, 32));
        l->a[j] = _mm256_add_epi64(l->a[j], _mm256_add_epi64(p, _mm256_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    __asm__("" : "+x"(l->a[0]), "+x"(l->a[1]));   /* as in lanes_stripe */
}

static inline void lanes_scramble(lanes_t *l) {
    const __m256i prime = _mm256_set1_epi64x(XXH3_PRIME32_1);
    for (int j = 0; j < 2; j++) {
        __m256i key = _mm256_loadu_si256((const __m256i *)(xxh3_secret + XXH3_SCRAMBLE_KEY + 32 * j));
        __m256i a = _mm256_xor_si256(_mm256_xor_si256(l->a[j], _mm256_srli_epi64(l->a[j], 47)), key);
        /* a * PRIME32_1 mod 2^64, from 32x32 products: lo(a) * p + (hi(a) * p << 32) */
        __m256i lo = _mm256_mul_epu32(a, prime);
        __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        l->a[j] = _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32));
    }
}

#elif defined(XXH3_KERNEL_SSE2)
#include <emmintrin.h>

typedef struct { __m128i a[4]; } lanes_t;   /* the AVX2 kernel's steps, two lanes a register */

static inline lanes_t lanes_load(const uint64_t acc[8]) {
    lanes_t l;
    for (int j = 0; j < 4; j++)
        l.a[j] = _mm_loadu_si128((const __m128i *)(acc + 2 * j));
    return l;
}

static inline void lanes_store(uint64_t acc[8], lanes_t l) {
    for (int j = 0; j < 4; j++)
        _mm_storeu_si128((__m128i *)(acc + 2 * j), l.a[j]);
}

static inline void lanes_stripe(lanes_t *l, const uint8_t *in, const uint8_t *key) {
    for (int j = 0; j < 4; j++) {
        __m128i d = _mm_loadu_si128((const __m128i *)(in + 16 * j));
        __m128i k = _mm_xor_si128(d, _mm_loadu_si128((const __m128i *)(key + 16 * j)));
        __m128i p = _mm_mul_epu32(k, _mm_srli_epi64(k, 32));
        l->a[j] = _mm_add_epi64(l->a[j], _mm_add_epi64(p, _mm_shuffle_epi32(d, _MM_SHUFFLE(1, 0, 3, 2))));
    }
    __asm__("" : "+x"(l->a[0]), "+x"(l->a[1]), "+x"(l->a[2]), "+x"(l->a[3]));   /* as in AVX2's */
}

static inline void lanes_scramble(lanes_t *l) {
    const __m128i prime = _mm_set1_epi64x(XXH3_PRIME32_1);
    for (int j = 0; j < 4; j++) {
        __m128i key = _mm_loadu_si128((const __m128i *)(xxh3_secret + XXH3_SCRAMBLE_KEY + 16 * j));
        __m128i a = _mm_xor_si128(_mm_xor_si128(l->a[j], _mm_srli_epi64(l->a[j], 47)), key);
        __m128i lo = _mm_mul_epu32(a, prime);
        __m128i hi = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
        l->a[j] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
    }
}

#else   /* portable C, lane by lane: the reference the vector kernels are tested against */

typedef struct { uint64_t a[8]; } lanes_t;

static inline lanes_t lanes_load(const uint64_t acc[8]) {
    lanes_t l;
    memcpy(l.a, acc, sizeof(l.a));
    return l;
}

static inline void lanes_store(uint64_t acc[8], lanes_t l) {
    memcpy(acc, l.a, sizeof(l.a));
}

static inline void lanes_stripe(lanes_t *l, const uint8_t *in, const uint8_t *key) {
    for (int i = 0; i < 8; i++) {
        uint64_t d = xxh3_read64(in + 8 * i);
        uint64_t k = d ^ xxh3_read64(key + 8 * i);
        l->a[i ^ 1] += d;
        l->a[i] += (k & 0xFFFFFFFFu) * (k >> 32);
    }
}

static inline void lanes_scramble(lanes_t *l) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = l->a[i];
        a ^= a >> 47;
        a ^= xxh3_read64(xxh3_secret + XXH3_SCRAMBLE_KEY + 8 * i);
        l->a[i] = a * XXH3_PRIME32_1;
    }
}
#endif

/* `count` stripes from `in`, each with at least one byte after it in the stream, continuing the
 * block that `*stripes` stripes of have been folded already: the rest of that block, whole
 * blocks (unrolled, so each stripe's key is a constant offset), then the start of the next. The
 * lanes stay in registers throughout. With `out` (an address; the kernels with XXH3_COPY_ALIGN only),
 * each stripe is also written there (lanes_stripe_copy); inlined always, so that a fold without one has
 * no branch. */
#ifdef XXH3_COPY_ALIGN
#define STRIPE(l, in, out, key) \
    ((out) ? lanes_stripe_copy(l, in, (uint8_t *)(out), key) : lanes_stripe(l, in, key))
#else
#define STRIPE(l, in, out, key) lanes_stripe(l, in, key)
#endif
static inline __attribute__((always_inline)) void fold_to(uint64_t acc[8], uint32_t *stripes, const uint8_t *in,
                                                          uintptr_t out, size_t count) {
    if (!count)
        return;
    lanes_t l = lanes_load(acc);
    size_t s = *stripes;
    const size_t step = out ? 64 : 0;
    if (s) {
        for (; s < XXH3_BLOCK_STRIPES && count; s++, count--, in += 64, out += step)
            STRIPE(&l, in, out, xxh3_secret + 8 * s);
        if (s == XXH3_BLOCK_STRIPES) {
            lanes_scramble(&l);
            s = 0;
        }
    }
    for (; count >= XXH3_BLOCK_STRIPES; count -= XXH3_BLOCK_STRIPES, in += 64 * XXH3_BLOCK_STRIPES,
                                        out += step * XXH3_BLOCK_STRIPES) {
#pragma GCC unroll 16
        for (int b = 0; b < XXH3_BLOCK_STRIPES; b++)
            STRIPE(&l, in + 64 * b, out + step * b, xxh3_secret + 8 * b);
        lanes_scramble(&l);
    }
    for (; count; s++, count--, in += 64, out += step)
        STRIPE(&l, in, out, xxh3_secret + 8 * s);
    *stripes = (uint32_t)s;
    lanes_store(acc, l);
}

#undef STRIPE

static inline void fold(uint64_t acc[8], uint32_t *stripes, const uint8_t *in, size_t count) {
    fold_to(acc, stripes, in, 0, count);
}

/* The accumulators' end: the stripe that ends the stream (`last`: its 64 bytes), then the merge. */
static inline uint64_t finish(uint64_t acc[8], const uint8_t *last, uint64_t total) {
    lanes_t l = lanes_load(acc);
    lanes_stripe(&l, last, xxh3_secret + XXH3_LAST_STRIPE_KEY);
    lanes_store(acc, l);
    return xxh3_merge(acc, total);
}

uint64_t XXH3_NAME(xxh3_64, XXH3_KERNEL)(const uint8_t *data, size_t nbytes) {
    if (nbytes <= XXH3_SHORT_MAX)
        return xxh3_short(data, nbytes);
    uint64_t acc[8];
    uint32_t stripes = 0;
    memcpy(acc, xxh3_acc_init, sizeof(acc));
    fold(acc, &stripes, data, (nbytes - 1) / 64);
    return finish(acc, data + nbytes - 64, nbytes);
}

void XXH3_NAME(xxh3_update, XXH3_KERNEL)(xxh3_state_t *state, const uint8_t *data, size_t nbytes) {
    uint8_t *held = state->hold + XXH3_STRIPE_BYTES;
    state->total += nbytes;
    if (nbytes <= XXH3_HOLD_BYTES - state->held) {
        memcpy(held + state->held, data, nbytes);
        state->held += (uint32_t)nbytes;
        return;
    }
    /* More than the hold takes: the stream is a long one, and everything before the last byte of
     * `data` can be folded. First the held bytes, made whole stripes from the front of `data`. */
    if (state->held) {
        size_t fill = (XXH3_STRIPE_BYTES - state->held % XXH3_STRIPE_BYTES) % XXH3_STRIPE_BYTES;
        memcpy(held + state->held, data, fill);
        data += fill;
        nbytes -= fill;
        size_t folded = state->held + fill;
        fold(state->acc, &state->stripes, held, folded / 64);
        if (nbytes <= XXH3_STRIPE_BYTES) {
            /* the stream's last 64 bytes: the end of what was held, then `data` */
            memcpy(state->hold + nbytes, held + folded - (XXH3_STRIPE_BYTES - nbytes), XXH3_STRIPE_BYTES - nbytes);
            memcpy(held, data, nbytes);
            state->held = (uint32_t)nbytes;
            return;
        }
    }
    size_t count = (nbytes - 1) / 64;
    fold(state->acc, &state->stripes, data, count);
    data += 64 * count;
    nbytes -= 64 * count;   /* 1 to 64 bytes left: keep them and the bytes before, one stripe in all */
    memcpy(state->hold + nbytes, data + nbytes - XXH3_STRIPE_BYTES, XXH3_STRIPE_BYTES);
    state->held = (uint32_t)nbytes;
}

uint64_t XXH3_NAME(xxh3_digest, XXH3_KERNEL)(const xxh3_state_t *state) {
    const uint8_t *held = state->hold + XXH3_STRIPE_BYTES;
    if (state->total <= XXH3_SHORT_MAX)
        return xxh3_short(held, state->held);
    uint64_t acc[8];
    uint32_t stripes = state->stripes;
    memcpy(acc, state->acc, sizeof(acc));
    fold(acc, &stripes, held, (state->held - 1) / 64);
    return finish(acc, held + state->held - XXH3_STRIPE_BYTES, state->total);
}

#ifdef XXH3_COPY_ALIGN
/* xxh3_update of `nbytes` read from `src`, each also written to `dst` (XXH3_COPY_ALIGN, or XXH3_COPY_SHIFTS
 * where the kernel has fold_to_shifted), the stream at
 * a stripe's end (xxh3_at_stripe): every byte is read from src once, and what is folded is exactly
 * what was written, whatever changes src meanwhile (another client's shared memory). The bulk goes
 * through registers (fold_to); a short input, and the last stripe and a half, through a buffer: from
 * it they are written, folded and kept. */
void XXH3_NAME(xxh3_update_copy, XXH3_KERNEL)(xxh3_state_t *state, uint8_t *dst, const uint8_t *src, size_t nbytes) {
    _Alignas(64) uint8_t bounce[XXH3_HOLD_BYTES + 2 * XXH3_STRIPE_BYTES];
    if (nbytes <= sizeof(bounce)) {
        for (size_t n; nbytes; src += n, dst += n, nbytes -= n) {
            n = nbytes < sizeof(bounce) ? nbytes : sizeof(bounce);
            memcpy(bounce, src, n);
            memcpy(dst, bounce, n);
            XXH3_NAME(xxh3_update, XXH3_KERNEL)(state, bounce, n);
        }
        return;
    }
    /* What xxh3_update does with an input longer than the hold, the held bytes being whole stripes
     * (written when they came). */
    state->total += nbytes;
    fold(state->acc, &state->stripes, state->hold + XXH3_STRIPE_BYTES, state->held / XXH3_STRIPE_BYTES);
    size_t bulk = 64 * ((nbytes - 1) / 64 - 1);
#ifdef XXH3_COPY_SHIFTS
    if ((uintptr_t)dst % XXH3_COPY_ALIGN)
        fold_to_shifted(state->acc, &state->stripes, src, dst, bulk / 64);
    else
#endif
        fold_to(state->acc, &state->stripes, src, (uintptr_t)dst, bulk / 64);
    size_t rest = nbytes - bulk;   /* 65 to 128 bytes: one stripe to fold, the 1 to 64 after it to keep */
    memcpy(bounce, src + bulk, rest);
    memcpy(dst + bulk, bounce, rest);
    fold(state->acc, &state->stripes, bounce, 1);
    state->held = (uint32_t)(rest - XXH3_STRIPE_BYTES);
    memcpy(state->hold + state->held, bounce + state->held, XXH3_STRIPE_BYTES);
}
#endif
