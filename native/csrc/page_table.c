/* The page index's keys (stored form, hashing), its key table (open addressing of slot numbers,
 * linear probing, backward-shift deletion; a tag byte and a distance byte beside each position)
 * and the table of live records by slot. */
#include <immintrin.h>
#include <string.h>

#include "page_index_parts.h"

/* ---------------------------------------------------------------- keys and hashing */

/* Each byte's value as a lowercase hex digit, -1 for any other byte; filled at import
 * (page_index_register). A table, not a comparison per digit: on random keys those branches
 * mispredict about once a digit, which made decoding most of a long lookup's time. */
static int8_t hex_value[256];

/* Whether the CPU decodes with AVX2 (hex64_avx2); known at import, with hex_value. */
static int decode_avx2;

void hex_value_fill(void) {
    for (int c = 0; c < 256; c++)
        hex_value[c] = (int8_t)(c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1);
    __builtin_cpu_init();
    decode_avx2 = __builtin_cpu_supports("avx2");
}

/* 64 lowercase hex digits into their 32 bytes, 32 digits a step; 0 (and `out` unspecified) when any
 * byte is not one. A long lookup decodes every key it is given, and the table decode was a quarter
 * of its time. Agrees with the table byte for byte: tests/unit/test_native_index.py tries keys one
 * byte off a digit's range at several positions. */
__attribute__((target("avx2")))
static int hex64_avx2(const uint8_t *in, uint8_t *out) {
    const __m256i nine = _mm256_set1_epi8(9), five = _mm256_set1_epi8(5);
    for (int half = 0; half < 2; half++) {
        __m256i c = _mm256_loadu_si256((const __m256i *)(in + 32 * half));
        __m256i digit = _mm256_sub_epi8(c, _mm256_set1_epi8('0'));
        __m256i letter = _mm256_sub_epi8(c, _mm256_set1_epi8('a'));
        /* x <= n, unsigned: min(x, n) == x */
        __m256i is_digit = _mm256_cmpeq_epi8(_mm256_min_epu8(digit, nine), digit);
        __m256i is_letter = _mm256_cmpeq_epi8(_mm256_min_epu8(letter, five), letter);
        if ((uint32_t)_mm256_movemask_epi8(_mm256_or_si256(is_digit, is_letter)) != UINT32_MAX)
            return 0;
        __m256i value = _mm256_blendv_epi8(_mm256_add_epi8(letter, _mm256_set1_epi8(10)), digit, is_digit);
        /* each pair of digits: high * 16 + low, as 16 bits; then packed to bytes within each 128-bit lane */
        __m256i pairs = _mm256_maddubs_epi16(value, _mm256_set1_epi16(0x0110));
        __m256i packed = _mm256_packus_epi16(pairs, pairs);
        uint64_t low = (uint64_t)_mm256_extract_epi64(packed, 0), high = (uint64_t)_mm256_extract_epi64(packed, 2);
        memcpy(out + 16 * half, &low, 8);
        memcpy(out + 16 * half + 8, &high, 8);
    }
    return 1;
}

/* hex64_avx2 by table, for CPUs without AVX2. */
static int hex64_table(const uint8_t *in, uint8_t *out) {
    int bad = 0;   /* any digit's -1 makes it negative */
    for (size_t i = 0; i < 32; i++) {
        int hi = hex_value[in[2 * i]], lo = hex_value[in[2 * i + 1]];
        bad |= hi | lo;
        out[i] = (uint8_t)((unsigned)hi << 4 | (unsigned)lo);   /* unused unless every digit is one */
    }
    return bad >= 0;
}

int hex64_decode(const uint8_t *in, uint8_t *out) {
    return decode_avx2 ? hex64_avx2(in, out) : hex64_table(in, out);
}

/* The stored form of a key: a 64-character lowercase hex key as its 32 bytes. */
void key_encode(pkey_t *k, const uint8_t *data, size_t len) {
    k->hex = len == 64 && hex64_decode(data, k->bytes);
    k->data = k->hex ? k->bytes : data;
    k->len = k->hex ? 32 : len;
}

static inline uint64_t rotl64(uint64_t x, int r) {
    return x << r | x >> (64 - r);
}

uint64_t key_hash_seeded(uint64_t seed, const uint8_t *data, size_t len) {
    uint64_t h = seed ^ len;
    size_t i = 0;
    /* 32 bytes at a time in four lanes mixed side by side, then folded: a hex key's 32-byte digest costs
     * one multiply chain's latency instead of four in a row (the chain was a third of a long lookup's
     * probing). Every lane starts from the seeded h, so no lane's value is known to a caller. */
    for (; i + 32 <= len; i += 32) {
        uint64_t w[4];
        memcpy(w, data + i, 32);
        uint64_t a = mix64(h ^ w[0]), b = mix64((h + UINT64_C(0x9e3779b97f4a7c15)) ^ w[1]);
        uint64_t c = mix64((h + UINT64_C(0x3c6ef372fe94f82a)) ^ w[2]), d = mix64((h + UINT64_C(0xdaa66d2c7ddf743f)) ^ w[3]);
        h = a ^ rotl64(b, 16) ^ rotl64(c, 32) ^ rotl64(d, 48);
    }
    for (; i + 8 <= len; i += 8) {
        uint64_t w;
        memcpy(&w, data + i, 8);
        h = mix64(h ^ w) + i;
    }
    if (i < len) {   /* 1 to 7 bytes left: read in fixed-size loads that cover each (no memcpy call) */
        const uint8_t *rest = data + i;
        size_t left = len - i;
        uint64_t w;
        if (left >= 4) {
            uint32_t head, tail;
            memcpy(&head, rest, 4);
            memcpy(&tail, rest + left - 4, 4);
            w = (uint64_t)head << 32 | tail;
        } else {
            w = (uint64_t)rest[0] << 16 | (uint64_t)rest[left / 2] << 8 | rest[left - 1];
        }
        h = mix64(h ^ w ^ UINT64_C(0x9e3779b97f4a7c15));
    }
    return mix64(h);
}

uint64_t key_seed(const index_t *self, uint32_t ns, int hex) {
    return self->seed ^ mix64((uint64_t)ns << 1 | (uint64_t)hex);
}

uint64_t key_hash(const index_t *self, uint32_t ns, const uint8_t *data, size_t len, int hex) {
    return key_hash_seeded(key_seed(self, ns, hex), data, len);
}

uint64_t page_hash(const index_t *self, const page_t *p) {
    return key_hash(self, p->ns, page_key(p), p->key_len, (p->flags & F_HEX) != 0);
}

int page_matches(const page_t *p, uint32_t ns, const pkey_t *k) {
    return p->ns == ns && p->key_len == k->len && ((p->flags & F_HEX) != 0) == k->hex
           && memcmp(page_key(p), k->data, k->len) == 0;
}

PyObject *page_key_object(const page_t *p) {
    const uint8_t *data = page_key(p);
    if (!(p->flags & F_HEX))
        return PyBytes_FromStringAndSize((const char *)data, p->key_len);
    static const char digits[] = "0123456789abcdef";
    PyObject *out = PyBytes_FromStringAndSize(NULL, 64);
    if (!out)
        return NULL;
    char *s = PyBytes_AS_STRING(out);
    for (int i = 0; i < 32; i++) {
        s[2 * i] = digits[data[i] >> 4];
        s[2 * i + 1] = digits[data[i] & 15];
    }
    return out;
}

/* ---------------------------------------------------------------- the key table */

/* Beside each table position, one byte of its page's hash (never 0; 0 marks an empty position): a probe
 * reads a page's slot only when this byte matches, so a key that is absent (every new page of a put)
 * costs the probe run in this byte array, not a cache miss on a page slot per position passed. */
static inline uint8_t hash_tag(uint64_t h) {
    uint8_t tag = (uint8_t)(h >> 56);
    return tag ? tag : 1;
}

/* A distance of FAR or more is stored as FAR, and read back from the page's hash. */
#define FAR 255

static inline void set_distance(index_t *self, size_t position, size_t distance) {
    self->distances[position] = (uint8_t)(distance < FAR ? distance : FAR);
}

/* The page holding (ns, k), or NONE. `position`: where it is, or where it would go (the empty position
 * the probe stopped at; valid until the table next changes). */
uint32_t table_find(const index_t *self, uint32_t ns, const pkey_t *k, size_t *position) {
    if (!self->table)
        return NONE;
    return table_find_hashed(self, ns, k, key_hash(self, ns, k->data, k->len, k->hex), position);
}

/* table_find with the key's hash (key_hash) already taken. */
uint32_t table_find_hashed(const index_t *self, uint32_t ns, const pkey_t *k, uint64_t h, size_t *position) {
    uint8_t tag = hash_tag(h);
    for (size_t i = h & self->table_mask;; i = (i + 1) & self->table_mask) {
        uint8_t at_tag = self->tags[i];
        if (!at_tag) {
            if (position)
                *position = i;
            return NONE;
        }
        if (at_tag == tag && page_matches(&self->pages[self->table[i]], ns, k)) {
            if (position)
                *position = i;
            return self->table[i];
        }
    }
}

/* Put `page` at `position`, the empty one table_find gave for its key, whose hash is `h`. */
void table_put(index_t *self, size_t position, uint32_t page, uint64_t h) {
    self->tags[position] = hash_tag(h);
    self->table[position] = page;
    set_distance(self, position, (position - (h & self->table_mask)) & self->table_mask);
}

static void table_place(index_t *self, uint32_t page) {
    uint64_t h = page_hash(self, &self->pages[page]);
    size_t i = h & self->table_mask;
    while (self->tags[i])
        i = (i + 1) & self->table_mask;
    table_put(self, i, page, h);
}

int table_reserve(index_t *self, size_t count) {
    size_t capacity = self->table ? self->table_mask + 1 : 0;
    if (count * 10 <= capacity * 7)
        return 0;
    size_t grown = capacity ? capacity * 2 : 1024;
    while (count * 10 > grown * 7)
        grown *= 2;
    uint32_t *old = self->table;
    uint8_t *old_tags = self->tags, *old_distances = self->distances;
    self->table = malloc(grown * sizeof *self->table);
    self->tags = calloc(grown, 1);
    self->distances = malloc(grown);
    if (!self->table || !self->tags || !self->distances) {
        free(self->table);
        free(self->tags);
        free(self->distances);
        self->table = old;
        self->tags = old_tags;
        self->distances = old_distances;
        PyErr_NoMemory();
        return -1;
    }
    self->table_mask = grown - 1;
    /* The table holds exactly the pages alive: placed in slot order, a sequential read of the slots
     * (in the old table's order, a cache miss on a slot per page). */
    for (uint32_t page = 0; page < self->used; page++)
        if (self->pages[page].flags & F_ALIVE)
            table_place(self, page);
    free(old);
    free(old_tags);
    free(old_distances);
    return 0;
}

/* Whether the distance kept at `position` is its page's distance from its home (check_prefix_closed). */
int table_distance_agrees(const index_t *self, size_t position) {
    size_t home = page_hash(self, &self->pages[self->table[position]]) & self->table_mask;
    size_t distance = (position - home) & self->table_mask;
    return self->distances[position] == (distance < FAR ? distance : FAR);
}

/* Backward-shift deletion: no tombstones, probe runs stay as short as at insert. Each position's
 * distance from its home says whether its page may move back, without reading the page (at a full
 * cache's eviction rate, that read was a cache miss per position passed). */
void table_delete(index_t *self, size_t i) {
    size_t mask = self->table_mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!self->tags[j])
            break;
        uint32_t at = self->table[j];
        size_t distance = self->distances[j] < FAR ? self->distances[j]
                                                   : (j - (page_hash(self, &self->pages[at]) & mask)) & mask;
        size_t gap = (j - i) & mask;
        /* move `at` back to i unless its home lies cyclically in (i, j] */
        if (distance >= gap) {
            self->table[i] = at;
            self->tags[i] = self->tags[j];
            set_distance(self, i, distance - gap);
            i = j;
        }
    }
    self->tags[i] = 0;
    self->table_count--;
}

/* ---------------------------------------------------------------- proxies */

static inline size_t proxy_home(const index_t *self, uint32_t page) {
    return (size_t)(mix64(page) & self->proxy_mask);
}

PyObject *proxy_find(const index_t *self, uint32_t page) {
    if (!self->proxies)
        return NULL;
    for (size_t i = proxy_home(self, page);; i = (i + 1) & self->proxy_mask) {
        if (self->proxies[i].proxy == NULL)
            return NULL;
        if (self->proxies[i].page == page)
            return self->proxies[i].proxy;
    }
}

int proxy_put(index_t *self, uint32_t page, PyObject *proxy) {
    size_t capacity = self->proxies ? self->proxy_mask + 1 : 0;
    if ((self->proxy_count + 1) * 2 > capacity) {
        size_t grown = capacity ? capacity * 2 : 256;
        proxy_slot_t *old = self->proxies;
        self->proxies = calloc(grown, sizeof *self->proxies);
        if (!self->proxies) {
            self->proxies = old;
            PyErr_NoMemory();
            return -1;
        }
        self->proxy_mask = grown - 1;
        for (size_t i = 0; i < capacity; i++)
            if (old[i].proxy) {
                size_t j = proxy_home(self, old[i].page);
                while (self->proxies[j].proxy)
                    j = (j + 1) & self->proxy_mask;
                self->proxies[j] = old[i];
            }
        free(old);
    }
    size_t i = proxy_home(self, page);
    while (self->proxies[i].proxy)
        i = (i + 1) & self->proxy_mask;
    self->proxies[i].page = page;
    self->proxies[i].proxy = proxy;
    self->proxy_count++;
    return 0;
}

void proxy_drop(index_t *self, uint32_t page) {
    size_t mask = self->proxy_mask, i = proxy_home(self, page);
    while (self->proxies[i].page != page || !self->proxies[i].proxy)
        i = (i + 1) & mask;
    size_t j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (!self->proxies[j].proxy)
            break;
        size_t home = proxy_home(self, self->proxies[j].page);
        if ((j > i && (home <= i || home > j)) || (j < i && (home <= i && home > j))) {
            self->proxies[i] = self->proxies[j];
            i = j;
        }
    }
    self->proxies[i].proxy = NULL;
    self->proxy_count--;
}

