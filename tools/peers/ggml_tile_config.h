/* Forced into llama.cpp's build (-include) when GCC's _tile_loadconfig loses the tile
 * configuration: GCC 12's declares only 8 bytes of its 64-byte operand as read, so the
 * stores ggml makes to its tile configuration before it are dropped and the first tile
 * load dies with SIGILL. This _tile_loadconfig names all 64 bytes. */
#pragma once
#include <immintrin.h>
typedef struct { unsigned char bytes[64]; } zctl_tile_config_bytes;
#undef _tile_loadconfig
#define _tile_loadconfig(config) \
    __asm__ volatile("ldtilecfg %0" : : "m"(*(const zctl_tile_config_bytes *)(config)))
