/* One of the driver's other libraries (PTX JIT, NVVM, OpenCL, ...): present under its real file
 * name and SONAME so that injection and the loader can be tested; it exports one marker symbol. */
#ifndef SIM_SYMBOL
#error "build.py passes -DSIM_SYMBOL=<name> and -DSIM_DRIVER_VERSION=..."
#endif

const char *SIM_SYMBOL(void) { return SIM_DRIVER_VERSION; }
