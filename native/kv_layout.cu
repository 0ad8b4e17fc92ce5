// Gather/scatter of KV pages between the store's page bytes and an engine's paged KV cache.
//
// Compiled at run time (cupy RawModule / NVRTC), so installing kvstore needs no nvcc. One launch
// moves a whole call's pages. A page is a logical [kv][layer][token][head] grid of `chunk_bytes`
// runs (one head's dim, or more where both sides keep heads or tokens adjacent; the planner in
// kvstore_client/kv_layout.py merges them). The page side is a per-page address (the store's arena
// registered with CUDA, or an HBM pool opened over CUDA IPC) plus strides; the cache side is one
// base address per (kv, layer) (engines keep K and V, and each layer, in their own tensors) plus
// block and token/head strides. Every address and stride is a multiple of the word size, which
// the planner picks (16, 8, 4 or 1 bytes); strides are given in words.
//
// Thread blocks: grid.x = pages * kv * layers slabs, grid.y splits a large slab. Consecutive
// threads take consecutive words, so reads and writes coalesce within a chunk.

// The plan's numbers, in the order every kernel takes them (kv_layout.py, PLAN_FIELDS).
#define PLAN_PARAMS                                                                                   \
    long long kv, long long layers, long long tokens, long long heads, long long chunk_words,         \
    long long page_kv, long long page_layer, long long page_token, long long page_head,               \
    long long cache_block, long long cache_token, long long cache_head,                               \
    const unsigned long long* page_addrs, const long long* block_ids,                                 \
    const unsigned long long* cache_bases
#define PLAN_ARGS kv, layers, tokens, heads, chunk_words, page_kv, page_layer, page_token, page_head, \
    cache_block, cache_token, cache_head, page_addrs, block_ids, cache_bases

template <typename Word, bool ToCache>
__device__ __forceinline__ void copy_slab(PLAN_PARAMS) {
    long long slab = blockIdx.x;
    long long kv_layer = slab % (kv * layers);
    long long page = slab / (kv * layers);
    long long k = kv_layer / layers, layer = kv_layer % layers;
    Word* page_base = reinterpret_cast<Word*>(page_addrs[page]) + k * page_kv + layer * page_layer;
    Word* cache_base = reinterpret_cast<Word*>(cache_bases[kv_layer]) + block_ids[page] * cache_block;
    // Within a slab 32-bit indices suffice (the planner keeps a slab under 2^31 words), and
    // 32-bit division is several times cheaper than 64-bit on the GPU.
    unsigned int words = (unsigned int)(tokens * heads * chunk_words);
    unsigned int cw = (unsigned int)chunk_words, hs = (unsigned int)heads;
    unsigned int step = blockDim.x * gridDim.y;
    for (unsigned int w = blockIdx.y * blockDim.x + threadIdx.x; w < words; w += step) {
        unsigned int chunk = w / cw, word = w - chunk * cw;
        unsigned int token = chunk / hs, head = chunk - token * hs;
        Word* in_page = page_base + token * page_token + head * page_head + word;
        Word* in_cache = cache_base + token * cache_token + head * cache_head + word;
        if (ToCache) *in_cache = *in_page; else *in_page = *in_cache;
    }
}

#define KV_LAYOUT_KERNELS(SUFFIX, WORD)                                                               \
extern "C" __global__ void pages_to_cache_##SUFFIX(PLAN_PARAMS) { copy_slab<WORD, true>(PLAN_ARGS); } \
extern "C" __global__ void cache_to_pages_##SUFFIX(PLAN_PARAMS) { copy_slab<WORD, false>(PLAN_ARGS); }

KV_LAYOUT_KERNELS(w16, uint4)
KV_LAYOUT_KERNELS(w8, unsigned long long)
KV_LAYOUT_KERNELS(w4, unsigned int)
KV_LAYOUT_KERNELS(w1, unsigned char)
