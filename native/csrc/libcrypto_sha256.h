/* The part of OpenSSL's libcrypto that prefix_hash.c calls, declared here so that the build needs
 * no OpenSSL headers (libssl-dev): the low-level SHA-256 calls and their context, public and
 * unchanged from OpenSSL 0.9.8 to 3.x (in 3.x deprecated, still exported). setup.py links the
 * libcrypto that Python's own hashlib loads. */
#ifndef KVSTORE_NATIVE_LIBCRYPTO_SHA256_H
#define KVSTORE_NATIVE_LIBCRYPTO_SHA256_H
#include <stddef.h>

/* OpenSSL's SHA256_CTX (struct SHA256state_st), its SHA_LONG an unsigned int as on every LP64
 * Linux. */
typedef struct {
    unsigned int h[8];
    unsigned int Nl, Nh;
    unsigned int data[16];
    unsigned int num, md_len;
} SHA256_CTX;

_Static_assert(sizeof(SHA256_CTX) == 112, "SHA256_CTX is 28 32-bit words in OpenSSL's ABI");

/* Each returns 1 on success. */
int SHA256_Init(SHA256_CTX *c);
int SHA256_Update(SHA256_CTX *c, const void *data, size_t len);
int SHA256_Final(unsigned char *md, SHA256_CTX *c);
#endif
