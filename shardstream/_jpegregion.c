/* Decode one rectangle of a JPEG, not the whole image (libjpeg-turbo's partial decoding).
 *
 * A training crop (RandomResizedCrop) keeps about half of a photo. libjpeg-turbo can
 * skip the rows above the crop without their inverse DCT and colour conversion
 * (jpeg_skip_scanlines), decode only the columns around it (jpeg_crop_scanline), and
 * stop after its last row, so the rows below are never entropy-decoded at all (their
 * bytes are only looked through for markers: damage must fail every crop alike). On the
 * benchmark's ImageNet-sized photos with torchvision's crop distribution this took
 * 1.02 ms an image against 1.24 ms for a whole decode by the same library (and 1.29 ms
 * for simplejpeg's), on one core, reading a row a call; 5% less since, sixteen rows a
 * call (BENCHMARKS.md, fourteenth session). The pixels are the same bytes as the whole
 * decode's (tests/test_transforms.py compares them).
 *
 * Python side: shardstream/decode.py (decode_rgb_crop), which falls back to a whole
 * decode where this module is not built or refuses an image. Any libjpeg warning
 * (damaged data) is an error here, as in simplejpeg's strict mode, so damaged images
 * take the fallback's path and get the same treatment as before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} ErrorManager;

static void fail(j_common_ptr cinfo)
{
    ErrorManager *err = (ErrorManager *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void warn(j_common_ptr cinfo, int level)
{
    if (level < 0) /* a warning: corrupt or truncated data */
        fail(cinfo);
    /* level >= 0: trace messages, which nobody asked for */
}

/* Whether the rest of a single scan, from where the decode stopped, holds only entropy-coded
   data (0xFF stuffed as FF 00, restart markers) up to the end of image: any other marker
   there is damage, and so is a file that ends without its EOI. */
static int rest_is_clean(j_decompress_ptr cinfo)
{
    int marker = cinfo->unread_marker; /* one the decoder met already, if any */
    if (marker != 0 && !(marker >= 0xD0 && marker <= 0xD7))
        return marker == 0xD9;
    const JOCTET *p = cinfo->src->next_input_byte, *end = p + cinfo->src->bytes_in_buffer;
    while (p < end && (p = memchr(p, 0xFF, (size_t)(end - p))) != NULL) {
        while (p < end && *p == 0xFF) /* fill bytes before a marker */
            p++;
        if (p == end)
            return 0;
        JOCTET code = *p++;
        if (code != 0x00 && !(code >= 0xD0 && code <= 0xD7))
            return code == 0xD9;
    }
    return 0;
}

/* Runs without the GIL. Returns 0, or -1 with `message` set. */
static int decode(const unsigned char *data, size_t size, int denom, JDIMENSION top, JDIMENSION left,
                  JDIMENSION height, JDIMENSION width, unsigned char *out, char *message)
{
    struct jpeg_decompress_struct cinfo;
    ErrorManager err;

    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fail;
    err.pub.emit_message = warn;
    jpeg_create_decompress(&cinfo);
    if (setjmp(err.jump)) {
        memcpy(message, err.message, JMSG_LENGTH_MAX);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    if (denom > 1 && cinfo.max_h_samp_factor * cinfo.max_v_samp_factor > 4) {
        /* 4:1:0 and rarer: skipping and cropping at a reduction gave other pixels than the
           whole decode (up to 71 levels); the caller decodes those whole. */
        snprintf(message, JMSG_LENGTH_MAX, "sampling %dx%d is not decoded by region at a reduction",
                 cinfo.max_h_samp_factor, cinfo.max_v_samp_factor);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_start_decompress(&cinfo);
    if (cinfo.output_components != 3 || top + height > cinfo.output_height || left + width > cinfo.output_width) {
        snprintf(message, JMSG_LENGTH_MAX, "region %ux%u at (%u, %u) is outside the %ux%u image", width, height,
                 left, top, cinfo.output_width, cinfo.output_height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    /* One column more on each side than asked for: fancy upsampling reads a neighbour
       column, and at the edge of a cropped scanline it would take the edge for the
       image's edge (pixels differed by up to 38 levels in the first and last columns
       without this). jpeg_crop_scanline then widens the span to whole iMCUs. */
    JDIMENSION x = left > 0 ? left - 1 : 0;
    JDIMENSION right = left + width + 1 < cinfo.output_width ? left + width + 1 : cinfo.output_width;
    /* A span of two columns at an edge holds one chroma column of a 4:2:0 image, which
       h2v2 fancy upsampling takes for the image's edge (16 levels off); with a component
       sampled 4 times across (rare mixed samplings) three columns were not enough either
       (up to 36 levels off): two chroma columns' worth, and one more, are. */
    JDIMENSION least = 2 * (JDIMENSION)cinfo.max_h_samp_factor + 1;
    if (right - x < least) {
        right = x + least < cinfo.output_width ? x + least : cinfo.output_width;
        x = right > least ? right - least : 0;
    }
    JDIMENSION span = right - x;
    jpeg_crop_scanline(&cinfo, &x, &span);
    size_t skip = (size_t)(left - x) * 3, row_bytes = (size_t)width * 3;
    if (top > 0 && jpeg_skip_scanlines(&cinfo, top) != top) {
        snprintf(message, JMSG_LENGTH_MAX, "could not skip %u rows", top);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    /* Sixteen rows a call, straight into `out` where the decoded span is the region:
       libjpeg's per-call overhead, paid once a row before, cost about 5% of a crop's decode
       (9% of a whole image's) on the benchmark's photos. The row buffers are freed with
       the decompressor, on the error path too. */
    enum { ROWS = 16 };
    JSAMPROW rows[ROWS];
    int direct = skip == 0 && span == width;
    JSAMPARRAY spans = direct ? NULL : (*cinfo.mem->alloc_sarray)((j_common_ptr)&cinfo, JPOOL_IMAGE, span * 3, ROWS);
    for (JDIMENSION y = 0; y < height;) {
        JDIMENSION want = height - y < ROWS ? height - y : ROWS;
        for (JDIMENSION i = 0; i < want; i++)
            rows[i] = direct ? out + (size_t)(y + i) * row_bytes : spans[i];
        JDIMENSION got = jpeg_read_scanlines(&cinfo, rows, want);
        if (got == 0) {
            snprintf(message, JMSG_LENGTH_MAX, "row %u could not be read", top + y);
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        for (JDIMENSION i = 0; i < got && !direct; i++)
            memcpy(out + (size_t)(y + i) * row_bytes, spans[i] + skip, row_bytes);
        y += got;
    }
    /* The rows below the region are never decoded. Damage there that a whole decode fails
       on must fail every crop alike (else whether a damaged sample is skipped depends on
       the epoch's draw): a file of several scans was read whole at jpeg_start_decompress,
       and in the rest of a single scan the damage a decode fails on is a marker, which a
       look for 0xFF bytes finds without decoding anything (a few microseconds). */
    if (!jpeg_has_multiple_scans(&cinfo) && !rest_is_clean(&cinfo)) {
        snprintf(message, JMSG_LENGTH_MAX, "a marker inside the image data below row %u", top + height);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_abort_decompress(&cinfo);
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

PyDoc_STRVAR(decode_region_doc,
"decode_region(data, out, denom, top, left, height, width) -> None\n\n"
"Decode the region (top, left, height, width) of the JPEG in `data`, scaled by\n"
"1/denom (1, 2, 4 or 8) as libjpeg scales, into `out`: a writable buffer of at least\n"
"height * width * 3 bytes, filled as RGB rows. Raises ValueError on anything libjpeg\n"
"refuses or warns about, and on a region outside the scaled image.");

static PyObject *decode_region(PyObject *self, PyObject *args)
{
    Py_buffer data, out;
    int denom, top, left, height, width;
    char message[JMSG_LENGTH_MAX];
    int status;

    if (!PyArg_ParseTuple(args, "y*w*iiiii", &data, &out, &denom, &top, &left, &height, &width))
        return NULL;
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_Format(PyExc_ValueError, "denom must be 1, 2, 4 or 8, not %d", denom);
        goto error;
    }
    if (top < 0 || left < 0 || height <= 0 || width <= 0) {
        PyErr_Format(PyExc_ValueError, "bad region: top %d, left %d, height %d, width %d", top, left, height, width);
        goto error;
    }
    if (out.len < (Py_ssize_t)height * width * 3) {
        PyErr_Format(PyExc_ValueError, "out holds %zd bytes, the region needs %zd", out.len,
                     (Py_ssize_t)height * width * 3);
        goto error;
    }
    Py_BEGIN_ALLOW_THREADS
    status = decode((const unsigned char *)data.buf, (size_t)data.len, denom, (JDIMENSION)top, (JDIMENSION)left,
                    (JDIMENSION)height, (JDIMENSION)width, (unsigned char *)out.buf, message);
    Py_END_ALLOW_THREADS
    if (status != 0) {
        PyErr_SetString(PyExc_ValueError, message);
        goto error;
    }
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
error:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return NULL;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS, decode_region_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_jpegregion", "Partial JPEG decoding through libjpeg-turbo.", -1, methods,
};

PyMODINIT_FUNC PyInit__jpegregion(void)
{
    return PyModule_Create(&module);
}
