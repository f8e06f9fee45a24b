/*
 * secret.c — the cluster secret (32 random bytes in a 0600 file), keys derived from it for one
 * purpose each, the keyed MAC and the authenticated encryption that disk pages use, and the
 * atomic file writer every secret file of common/ goes through.
 *
 * Why it is built this way:
 *  - libsodium (already a dependency of CZMQ) does the cryptography: crypto_kdf derives a key per
 *    purpose, so the disk-page key never equals a key used anywhere else; crypto_generichash with
 *    a key is BLAKE2b as a MAC, faster than HMAC-SHA-512 on CPUs without SHA extensions and safe
 *    against length extension by construction.
 *  - A secret file that group or others can read is refused, as ssh refuses a readable private
 *    key: a leaked secret would let anyone forge pages, so the mistake must be loud.
 *  - Files are written to a temporary name beside the target, fsync'ed and renamed, so a reader
 *    (a ZAP handler re-reading a directory, a worker re-reading a key file) never sees half of one.
 */
#include "common/sec.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static pthread_once_t sodium_once = PTHREAD_ONCE_INIT;
static int sodium_rc;

static void sodium_start(void)
{
    sodium_rc = sodium_init() < 0 ? KM_EIO : 0;
}

int km_sodium_ready(void)
{
    pthread_once(&sodium_once, sodium_start);
    return sodium_rc;
}

int km_write_file_atomic(const char *path, const void *data, size_t len, unsigned mode,
                         km_errbuf *err)
{
    char tmp[PATH_MAX];
    const char *slash = strrchr(path, '/');
    int dl = slash ? (int)(slash - path + 1) : 0;
    if (snprintf(tmp, sizeof tmp, "%.*s.%s.tmp-%d", dl, path, slash ? slash + 1 : path,
                 (int)getpid()) >= (int)sizeof tmp)
        return km_errf(err, KM_EINVAL, "path too long: %s", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, mode & 0777);
    if (fd < 0) return km_errf(err, KM_EIO, "cannot create %s: %s", tmp, strerror(errno));
    int rc = 0;
    const uint8_t *b = data;
    size_t left = len;
    while (left && !rc) {
        ssize_t w = write(fd, b, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0)
            rc = km_errf(err, KM_EIO, "cannot write %s: %s", tmp, strerror(errno));
        else {
            b += w;
            left -= (size_t)w;
        }
    }
    /* the umask may have narrowed the mode at open; a wider one is never wanted */
    if (!rc && fchmod(fd, mode & 0777))
        rc = km_errf(err, KM_EIO, "cannot chmod %s: %s", tmp, strerror(errno));
    if (!rc && fsync(fd)) rc = km_errf(err, KM_EIO, "cannot fsync %s: %s", tmp, strerror(errno));
    if (close(fd) && !rc) rc = km_errf(err, KM_EIO, "cannot close %s: %s", tmp, strerror(errno));
    if (!rc && rename(tmp, path))
        rc = km_errf(err, KM_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (rc) unlink(tmp);
    return rc;
}

int km_secret_generate_file(const char *path, km_errbuf *err)
{
    if (km_sodium_ready()) return km_errf(err, KM_EIO, "libsodium failed to initialise");
    struct stat st;
    if (lstat(path, &st) == 0) return km_errf(err, KM_EINVAL, "%s exists: not overwritten", path);
    uint8_t key[KM_SECRET_BYTES];
    char hex[2 * KM_SECRET_BYTES + 2];
    randombytes_buf(key, sizeof key);
    sodium_bin2hex(hex, sizeof hex - 1, key, sizeof key);
    hex[2 * KM_SECRET_BYTES] = '\n';
    int rc = km_write_file_atomic(path, hex, sizeof hex - 1, 0600, err);
    sodium_memzero(key, sizeof key);
    sodium_memzero(hex, sizeof hex);
    return rc;
}

int km_secret_load(const char *path, uint8_t out[KM_SECRET_BYTES], km_errbuf *err)
{
    if (km_sodium_ready()) return km_errf(err, KM_EIO, "libsodium failed to initialise");
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return km_errf(err, KM_EIO, "cannot open secret %s: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) || !S_ISREG(st.st_mode)) {
        close(fd);
        return km_errf(err, KM_EINVAL, "secret %s is not a regular file", path);
    }
    if (st.st_mode & 077) {
        close(fd);
        return km_errf(err, KM_EINVAL, "secret %s has mode %03o: others can read it (chmod 600)",
                       path, (unsigned)(st.st_mode & 0777));
    }
    char buf[160];
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n < 0) return km_errf(err, KM_EIO, "cannot read secret %s: %s", path, strerror(errno));
    buf[n] = '\0';
    size_t len = (size_t)n;
    while (len && (buf[len - 1] == '\n' || buf[len - 1] == '\r' || buf[len - 1] == ' '))
        buf[--len] = '\0';
    size_t got = 0;
    const char *end = NULL;
    int rc = 0;
    if (len != 2 * KM_SECRET_BYTES ||
        sodium_hex2bin(out, KM_SECRET_BYTES, buf, len, NULL, &got, &end) || got != KM_SECRET_BYTES)
        rc = km_errf(err, KM_EFORMAT, "secret %s: want %d hex digits", path, 2 * KM_SECRET_BYTES);
    sodium_memzero(buf, sizeof buf);
    return rc;
}

void km_secret_derive(const uint8_t secret[KM_SECRET_BYTES], const char *context, uint64_t id,
                      uint8_t out[KM_SECRET_BYTES])
{
    char ctx[crypto_kdf_CONTEXTBYTES] = {0};
    size_t n = strlen(context);
    memcpy(ctx, context, n < sizeof ctx ? n : sizeof ctx);
    km_sodium_ready();
    crypto_kdf_derive_from_key(out, KM_SECRET_BYTES, id, ctx, secret);
}

void km_mac(const uint8_t key[KM_SECRET_BYTES], const void *data, size_t len,
            uint8_t out[KM_MAC_BYTES])
{
    km_sodium_ready();
    crypto_generichash(out, KM_MAC_BYTES, data, len, key, KM_SECRET_BYTES);
}

int km_mac_verify(const uint8_t key[KM_SECRET_BYTES], const void *data, size_t len,
                  const uint8_t tag[KM_MAC_BYTES])
{
    uint8_t want[KM_MAC_BYTES];
    km_mac(key, data, len, want);
    int ok = crypto_verify_32(want, tag) == 0;
    sodium_memzero(want, sizeof want);
    return ok ? 0 : KM_ECORRUPT;
}

_Static_assert(KM_SEAL_NONCE_BYTES == crypto_aead_xchacha20poly1305_ietf_NPUBBYTES &&
                   KM_SEAL_TAG_BYTES == crypto_aead_xchacha20poly1305_ietf_ABYTES &&
                   KM_SECRET_BYTES == crypto_aead_xchacha20poly1305_ietf_KEYBYTES,
               "km_seal's sizes are libsodium's");

/* XChaCha20's 192-bit nonce is safe to draw at random for every message under one key. */
void km_seal(const uint8_t key[KM_SECRET_BYTES], const void *ad, size_t ad_len, uint8_t *msg,
             size_t len, uint8_t nonce[KM_SEAL_NONCE_BYTES], uint8_t tag[KM_SEAL_TAG_BYTES])
{
    km_sodium_ready();
    randombytes_buf(nonce, KM_SEAL_NONCE_BYTES);
    crypto_aead_xchacha20poly1305_ietf_encrypt_detached(msg, tag, NULL, msg, len, ad, ad_len, NULL,
                                                        nonce, key);
}

int km_unseal(const uint8_t key[KM_SECRET_BYTES], const void *ad, size_t ad_len, uint8_t *msg,
              size_t len, const uint8_t nonce[KM_SEAL_NONCE_BYTES],
              const uint8_t tag[KM_SEAL_TAG_BYTES])
{
    km_sodium_ready();
    return crypto_aead_xchacha20poly1305_ietf_decrypt_detached(msg, NULL, msg, len, tag, ad, ad_len,
                                                               nonce, key)
               ? KM_ECORRUPT
               : 0;
}
