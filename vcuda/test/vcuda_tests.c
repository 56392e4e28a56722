/* vcuda_tests: the C test cases. `vcuda_tests --list` names them; each run
 * executes one case in a fresh process (the Go test drives this). */
int test_main(int argc, char **argv);
int main(int argc, char **argv) { return test_main(argc, argv); }
