/* A driver program that is only present for injection tests so far (nvidia-debugdump,
 * nvidia-persistenced, MPS control/server): prints its name and the driver version. */
#include <stdio.h>

#ifndef SIM_TOOL
#error "build.py passes -DSIM_TOOL=\"name\" and -DSIM_DRIVER_VERSION=..."
#endif

int main(void) {
    printf("%s: simulated, driver version %s\n", SIM_TOOL, SIM_DRIVER_VERSION);
    return 0;
}
