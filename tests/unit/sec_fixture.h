/*
 * sec_fixture.h — what the security tests (test_zsec*.c) share: a temporary key directory that
 * is removed with everything in it, and an assertion that prints a failed call's error message.
 */
#ifndef KM_TEST_SEC_FIXTURE_H
#define KM_TEST_SEC_FIXTURE_H

#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/sec.h"

static inline void rm_tree(const char *path)
{
    DIR *d = opendir(path);
    struct dirent *de;
    char p[1024];
    while (d && (de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (snprintf(p, sizeof p, "%s/%s", path, de->d_name) >= (int)sizeof p) continue;
        struct stat st;
        if (!lstat(p, &st) && S_ISDIR(st.st_mode))
            rm_tree(p);
        else
            unlink(p);
    }
    if (d) closedir(d);
    rmdir(path);
}

static inline void must(int rc, const km_errbuf *err)
{
    cr_assert_eq(rc, 0, "rc=%d (%s): %s", rc, km_strerror(rc), err->msg);
}

#endif
